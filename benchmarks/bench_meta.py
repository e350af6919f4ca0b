"""What the benchmarks record about the code they measured."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def source_commit() -> str:
    """The checkout's short HEAD, with ``+uncommitted changes`` when tracked files differ from
    it (a run of code no commit holds); ``BENCH_COMMIT`` from the environment outside a git
    checkout (a copy on a device machine)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return os.environ.get("BENCH_COMMIT", "")
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+uncommitted changes"
    return commit


def add_python_arg(ap: argparse.ArgumentParser) -> None:
    """``--python``: the interpreter a benchmark starts its servers with; by default the
    checkout's ``.venv`` where it has one (``make`` builds it), else the interpreter running the
    benchmark (a fresh clone run with another checkout's venv)."""
    venv = REPO / ".venv" / "bin" / "python"
    ap.add_argument("--python", default=str(venv) if venv.exists() else sys.executable,
                    help="the servers' interpreter (default: this checkout's .venv if it has "
                         "one, else the one running this script)")
