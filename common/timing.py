"""Per-request stage timing: where a request's time to first token goes (issue 12 item 4).

Off unless the environment has ``KV_PUSH_TIMING=1`` (read once, at import): then every
component -- router, the scheduler and worker halves of P and D, the transfer threads -- writes
one line per stage of each request it sees::

    kv_push_timing {"stage": "p_prefill_done", "tid": "...", "t": 1764765432.123456, "pid": 812, ...}

``t`` is wall-clock seconds (``time.time()``: the components are separate processes of one
host, so their stamps compare; across hosts they are only as good as the clocks' sync), ``tid``
the router's transfer id (the key that every component knows), and the other keys say which
request or peer. Lines go to stderr (each server's log), or, with ``KV_PUSH_TIMING_FILE=path``,
are appended to that file (one ``write`` per line, so processes sharing it do not interleave).
``benchmarks/bench_ttft_breakdown.py`` reads them back (``parse``).

Call sites test ``timing.ENABLED`` first, so that with timing off no argument is even built.

Stages, in the order a request meets them (the components that write them):

=====================  ======================================================================
``router_in``          router: the client's request arrived
``router_legs_sent``   router: both legs are on their way to P and D
``p_sched``            P scheduler: first look at the P leg (it is about to be scheduled)
``d_sched``            D scheduler: first look at the D leg
``d_expect``           D worker: the registration is handed to the transfer thread
``d_register_sent``    D transfer thread: ``Register`` sent to P (rank 0 of P's group)
``p_prefill_done``     P worker: the prefill is handed to the rendezvous (``how``: early_save,
                       early_bind or request_finished)
``p_step_output``      P scheduler: the prefill's step's output processed (P's one token
                       sampled, about to go to P's API server)
``p_pair``             P transfer thread: registration and prefill met
``p_write_posted``     P transfer thread: a WRITE chunk posted
``p_write_done``       P transfer thread: the WRITE completed locally
``d_write_done``       D transfer thread: the last ``WriteDone`` of the transfer arrived
``d_recv_reported``    D worker: the request reported received to vLLM (``finished_recving``)
``d_scheduled``        D scheduler: the request planned into a step after its KV arrived
``d_first_step_done``  D scheduler: that step's output processed (the first token sampled)
``router_p_done``      router: P's answer arrived
``router_first_byte``  router: the first bytes of D's answer went to the client
``router_out``         router: the exchange ended
=====================  ======================================================================
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Iterable

#: the environment variable that turns timing on (``1``)
ENV = "KV_PUSH_TIMING"
#: where the lines go instead of stderr, when set
FILE_ENV = "KV_PUSH_TIMING_FILE"
#: what each line starts with
PREFIX = "kv_push_timing "

ENABLED = os.environ.get(ENV, "") not in ("", "0")
_FILE = os.environ.get(FILE_ENV, "")


def stamp(stage: str, tid: str, **fields: Any) -> None:
    """Write one timing line for ``stage`` of transfer ``tid`` (callers test ``ENABLED``)."""
    rec = {"stage": stage, "tid": tid, "t": time.time(), "pid": os.getpid(), **fields}
    line = PREFIX + json.dumps(rec, default=str, separators=(",", ":")) + "\n"
    try:
        if _FILE:
            fd = os.open(_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        else:
            sys.stderr.write(line)
            sys.stderr.flush()
    except OSError:  # timing must never fail the work it times
        pass


def parse(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The timing records in ``lines`` (log lines; anything else is skipped)."""
    out = []
    for line in lines:
        i = line.find(PREFIX)
        if i < 0:
            continue
        try:
            rec = json.loads(line[i + len(PREFIX):])
        except ValueError:
            continue
        if isinstance(rec, dict) and "stage" in rec and "t" in rec:
            out.append(rec)
    return out
