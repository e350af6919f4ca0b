"""Where the connector's log records go inside vLLM.

The package logs through ``logging.getLogger(__name__)`` (``kv_push.common.*``) and attaches no
handler of its own. vLLM configures only its ``vllm`` logger (``VLLM_CONFIGURE_LOGGING``, on by
default) and leaves the root logger bare, so inside a vLLM server our records fell through to
Python's last-resort handler: INFO lines (start-up decisions, "rank 0/1 ready") were dropped and
WARNING lines came out without time, level or place, unlike every vLLM line beside them (seen
by a walkthrough, 2026-12-05).

:func:`follow_vllm_logging` sends the ``kv_push`` logger's records through vLLM's own handlers
(same format, same stream, vLLM's level), unless the application configured logging itself (a
handler on the root logger or on ``kv_push``) or turned vLLM's configuration off: then nothing
changes and the application decides. Records propagate to the root logger either way.
"""

from __future__ import annotations

import logging

#: the package's logger: every module's logger is a child of it
PACKAGE_LOGGER = "kv_push"


def follow_vllm_logging() -> bool:
    """Route ``kv_push`` records through the ``vllm`` logger's handlers (idempotent). Returns
    whether it did (False: the application's logging configuration applies)."""
    ours = logging.getLogger(PACKAGE_LOGGER)
    if ours.handlers or logging.getLogger().handlers:
        return False
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return False
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(vllm_logger.getEffectiveLevel())
    # records still propagate: a root handler installed later (the application's, pytest's
    # capture) gets them too
    return True
