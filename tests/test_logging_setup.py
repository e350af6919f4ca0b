"""The connector's log records come out through vLLM's handlers inside a vLLM process
(``common/logging_setup.py``): INFO included, with vLLM's format."""

from __future__ import annotations

import io
import logging

import pytest

from kv_push.common.logging_setup import PACKAGE_LOGGER, follow_vllm_logging


def _bare_root() -> None:
    """The root logger without handlers, as in a vLLM process (pytest adds its capture
    handlers to it for the test's call; the fixture restores them)."""
    logging.getLogger().handlers = []


@pytest.fixture
def loggers():
    """The root, vllm and kv_push loggers as a bare vLLM process has them; restored after."""
    names = ("", "vllm", PACKAGE_LOGGER)
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level,
                 logging.getLogger(n).propagate) for n in names}
    for n in names:
        logging.getLogger(n).handlers = []
    logging.getLogger(PACKAGE_LOGGER).setLevel(logging.NOTSET)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(filename)s] %(message)s"))
    yield stream, handler, _bare_root
    for n, (handlers, level, propagate) in saved.items():
        lg = logging.getLogger(n)
        lg.handlers, lg.propagate = handlers, propagate
        lg.setLevel(level)


def test_records_go_through_vllms_handlers_at_vllms_level(loggers):
    stream, handler, bare_root = loggers
    bare_root()
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(handler)
    vllm_logger.setLevel(logging.INFO)
    assert follow_vllm_logging()
    assert follow_vllm_logging() is False  # once: a second call adds nothing
    log = logging.getLogger("kv_push.common.worker")
    log.debug("not shown")
    log.info("kv_push: decoder rank 0/1 ready")
    log.warning("kv_push: dropping peer")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("INFO ") and lines[0].endswith("[test_logging_setup.py] "
                                                              "kv_push: decoder rank 0/1 ready")
    assert lines[1].startswith("WARNING ")


def test_an_application_that_configured_logging_keeps_its_configuration(loggers):
    stream, handler, bare_root = loggers
    bare_root()
    logging.getLogger("vllm").addHandler(handler)
    root_stream = io.StringIO()
    logging.getLogger().addHandler(logging.StreamHandler(root_stream))
    assert follow_vllm_logging() is False
    logging.getLogger("kv_push.common.worker").warning("kv_push: x")
    assert stream.getvalue() == "" and root_stream.getvalue() == "kv_push: x\n"


def test_without_vllms_logging_configuration_nothing_changes(loggers):
    loggers[2]()
    assert follow_vllm_logging() is False  # VLLM_CONFIGURE_LOGGING=0: no vllm handler
    assert logging.getLogger(PACKAGE_LOGGER).handlers == []
