"""Loopback ports for the servers the tests and benchmarks start, taken from below the kernel's
ephemeral range.

A port found free by binding port 0 comes from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), the range the kernel also
draws from for every outgoing connection's local port. Between the moment a test picks the port
and the moment a server binds it (a vLLM server binds its side channel 10-30 s after it starts),
the same machine opens hundreds of outgoing connections (health polls, vLLM's own process group
set-up, NIXL): one of them can take the port, and the server then fails to start with "address
already in use". Ports below that range are never handed out by the kernel on its own; only a
process that asks for one by number gets it.

``free_port()`` / ``free_ports(count)`` pick at random among those (two test runs on one machine
rarely meet), check that the port(s) can be bound right now, and never hand out a port twice in
one process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_HANDED_OUT: set[int] = set()
#: not the module-level generator: a test that seeds that one would make every run pick the
#: same ports
_RANDOM = random.SystemRandom()
#: the lowest port picked: above the registered services most machines run
_LOWEST = 20000


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """(first, last) of the kernel's ephemeral ports; Linux's default where it cannot be read."""
    try:
        first, last = (int(v) for v in Path(path).read_text().split()[:2])
        return first, last
    except (OSError, ValueError):
        return 32768, 60999


def _pool(count: int) -> range:
    """Base ports to pick from: below the ephemeral range if it leaves room, else above it."""
    first, last = ephemeral_range()
    if first - _LOWEST >= 1000 + count:
        return range(_LOWEST, first - count + 1)
    if 65535 - last >= 1000 + count:  # a machine that moved its ephemeral range down
        return range(last + 1, 65536 - count)
    return range(1024, 65536 - count)  # no room outside it: any port (bind-checked below)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int = 1) -> int:
    """A base port ``p`` with ``p .. p+count-1`` all free now, none handed out before by this
    process (a producer at TP ``count`` listens on ``p + rank``)."""
    pool = _pool(count)
    for _ in range(500):
        base = _RANDOM.choice(pool)
        run = range(base, base + count)
        if any(p in _HANDED_OUT for p in run):
            continue
        if all(_bindable(p) for p in run):
            _HANDED_OUT.update(run)
            return base
    raise RuntimeError(f"no {count} consecutive free loopback ports found in {pool}")


def free_port() -> int:
    """A loopback port nobody listens on now, never one this process handed out before."""
    return free_ports(1)
