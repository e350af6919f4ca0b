"""Notice when the vLLM server a worker belongs to is gone.

``kill -9`` of a vLLM server's API process (not of its process group) leaves its engine core and
workers running, re-parented to init (vLLM 0.29 and 0.32 do not notice; a plain vLLM server does
the same). Such an engine serves no client any more, yet our worker in it went on heartbeating,
kept its lifelines open and its side-channel port bound: a restarted P could not start ("cannot
listen on ...:5600: Address already in use"), and a producer kept an orphaned decoder as a live
peer (a walkthrough, 2026-12-05).

:class:`ServerWatch` finds the engine core process of the calling process -- itself or its
parent, told by vLLM's process title (``VLLM::EngineCore...``; ``VLLM::Worker...`` is a worker
of its parent) -- and remembers that engine's parent. :meth:`ServerWatch.gone` says when the
engine's parent changed (it died) or the engine itself is gone. Without vLLM's titles (no
``setproctitle``) a process started by ``multiprocessing`` watches its own parent; any other
process (a test, the demo run by hand) watches nothing. Linux ``/proc`` only: elsewhere nothing
is watched. ``KV_PUSH_SERVER_WATCH=0`` turns the watch off (``worker.py``): for an application
whose engine's parent exits by design while the engine serves on (with ``--api-server-count``
above 1, vLLM's engines belong to the launcher, not to an API server: killing the launcher alone
closes the workers while API servers may still be up).
"""

from __future__ import annotations

import multiprocessing
import os

#: vLLM's process titles (``{VLLM_PROCESS_NAME_PREFIX}::{name}``, prefix "VLLM" by default)
ENGINE_TITLE, WORKER_TITLE = "::EngineCore", "::Worker"


def parent_of(pid: int) -> int | None:
    """``pid``'s parent pid, or None when ``pid`` is gone, a zombie (dead, not yet reaped by
    its parent) or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        if fields[0] in (b"Z", b"X"):
            return None
        return int(fields[1])
    except (IndexError, ValueError):
        return None


def title_of(pid: int) -> str:
    """``pid``'s command line as ``ps`` shows it (vLLM's title where it set one)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return ""


class ServerWatch:
    def __init__(self, pid: int | None = None) -> None:
        """Watch the server of process ``pid`` (default: this one)."""
        me = os.getpid() if pid is None else pid
        self.engine: int | None = None  # the process whose parent is watched
        self.parent: int | None = None  # that parent, when the watch began
        ppid = parent_of(me)
        if ppid is None:
            return  # no /proc
        if ENGINE_TITLE in title_of(me):
            self.engine = me
        elif WORKER_TITLE in title_of(me) and ENGINE_TITLE in title_of(ppid):
            self.engine = ppid
        elif pid is None and multiprocessing.parent_process() is not None:
            self.engine = me  # started by multiprocessing: watch who started it
        if self.engine is not None:
            self.parent = parent_of(self.engine)
            if self.parent is None:
                self.engine = None

    @property
    def watching(self) -> bool:
        return self.engine is not None

    def gone(self) -> str | None:
        """Why the server is gone, or None while it is there (or nothing is watched)."""
        if self.engine is None:
            return None
        now = parent_of(self.engine)
        if now is None:
            return f"its engine process {self.engine} is gone"
        if now != self.parent:
            return (f"process {self.parent}, which started its engine process {self.engine}, "
                    f"is gone (the engine now belongs to process {now})")
        return None
