"""The version is written once, in ``kv_push/__init__.py``; the package metadata reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

import kv_push

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_pyproject_takes_its_version_from_the_package():
    pyprojecttoml = pytest.importorskip("setuptools.config.pyprojecttoml")
    project = pyprojecttoml.read_configuration(PYPROJECT)["project"]  # expands dynamic fields
    assert "version" in project.get("dynamic", ())  # not a second literal copy
    assert project["version"] == kv_push.__version__
