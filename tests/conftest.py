"""Shared fixtures and hooks for the test suite.

* ``nixl`` marker: tests that move bytes through real NIXL agents in separate processes; they are
  skipped when the ``nixl`` package is not importable here.
* ``free_port()`` / ``free_port_pair()``: ports nobody listens on (for side channels and for the
  "connection refused" case).
* ``start_peers(*specs)``: start several ``LocalPeer`` processes at once (each spends ~1-2 s
  importing NIXL and creating its agent; started together they overlap) and ``close_peers``.
* ``live_state`` / ``assert_no_leaks``: what producers (sources, jobs, rendezvous entries,
  transfers, staging rooms) and decoders (wants, staging slots) still hold.
* ``figures``: a session-wide dict that tests record measurements into (time to detect a dead
  peer, latencies...); ``pytest_terminal_summary`` prints it as a table at the end of the run.
"""

from __future__ import annotations

import importlib.util
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

try:
    from kv_push.common.testing.vllm_servers import DTYPE_ENV, e2e_exact_dtype
except ImportError:  # a minimal environment (the GPU machine's: no httpx), where no e2e runs
    DTYPE_ENV, e2e_exact_dtype = "", None

HAVE_NIXL = importlib.util.find_spec("nixl") is not None

# the end-to-end servers' dtype on CPUs that emulate bf16: float32, so that P/D's outputs equal
# a single server's token for token (vllm_servers.e2e_exact_dtype says why)
if e2e_exact_dtype is not None and (_exact := e2e_exact_dtype()) is not None:
    os.environ[DTYPE_ENV] = _exact

#: section -> list of (what, value, note) rows, printed at the end of the session
FIGURES: dict[str, list[tuple[str, str, str]]] = {}


def pytest_collection_modifyitems(config, items):
    if HAVE_NIXL:
        return
    skip = pytest.mark.skip(reason="nixl is not importable here (pip install 'kv-push[nixl]')")
    for item in items:
        if "nixl" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not FIGURES:
        return
    tr = terminalreporter
    tr.section("measured figures")
    for section, rows in FIGURES.items():
        tr.write_line(f"[{section}]")
        w = max(len(r[0]) for r in rows)
        v = max(len(r[1]) for r in rows)
        for what, value, note in rows:
            tr.write_line(f"  {what:<{w}}  {value:>{v}}  {note}")


@pytest.fixture(scope="session")
def figures():
    """``figures(section, what, value, note="")`` records one row of the closing summary."""
    def record(section: str, what: str, value, note: str = "") -> None:
        if isinstance(value, float):
            value = f"{value * 1000:.1f} ms" if value < 10 else f"{value:.2f} s"
        FIGURES.setdefault(section, []).append((what, str(value), note))
    return record


def free_port() -> int:
    """A loopback port nobody listens on now (``kv_push.common.testing.ports``)."""
    from kv_push.common.testing.ports import free_port as pick

    return pick()


def free_port_pair(count: int = 2) -> int:
    """A base port ``p`` with ``p .. p+count-1`` all free right now (for producer TP groups)."""
    from kv_push.common.testing.ports import free_ports

    return free_ports(count)


def bindable(port: int) -> bool:
    """Whether a listener could bind ``port`` on loopback now (SO_REUSEADDR, as servers do)."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def start_peers(*specs, concurrency: int = 3, start_timeout: float = 180.0):
    """Start ``LocalPeer`` processes for ``specs``, a few at a time (start-up is CPU-bound: on a
    small, shared machine more at once only makes each slower); all or nothing."""
    from kv_push.common.testing.peer_process import LocalPeer

    with ThreadPoolExecutor(min(concurrency, len(specs))) as pool:
        futures = [pool.submit(LocalPeer, spec, start_timeout) for spec in specs]
    peers, errors = [], []
    for f in futures:
        try:
            peers.append(f.result())
        except Exception as e:  # noqa: BLE001 - re-raised below after cleaning up
            errors.append(e)
    if errors:
        close_peers(*peers)
        raise errors[0]
    return peers


def close_peers(*peers) -> None:
    """Close peers concurrently (each close joins a transfer thread and an agent)."""
    live = [p for p in peers if p is not None]
    if not live:
        return
    with ThreadPoolExecutor(len(live)) as pool:
        list(pool.map(lambda p: p.close(), live))


def live_state(producers, decoders) -> dict[str, dict[str, int]]:
    """Per peer (by process name and pid), what it still holds."""
    state = {}
    for p in producers:
        state[f"{p.process.name}[{p.process.pid}]"] = {
            k: v for k, v in p.call("live").items() if k != "peers"}
    for d in decoders:
        state[f"{d.process.name}[{d.process.pid}]"] = {
            k: v for k, v in d.call("live").items() if k in ("wants", "staging_slots")}
    return state


def assert_no_leaks(producers, decoders, baseline=None, timeout: float = 3.0) -> None:
    """Nothing left: no sources/jobs/rendezvous/transfers on producers, no wants on decoders
    (beyond ``baseline``, a ``live_state`` taken before, so one failure is reported once)."""
    baseline = baseline or {}
    deadline = time.monotonic() + timeout
    while True:
        state = live_state(producers, decoders)
        extra = {peer: {k: v for k, v in held.items() if v > baseline.get(peer, {}).get(k, 0)}
                 for peer, held in state.items()}
        extra = {peer: held for peer, held in extra.items() if held}
        if not extra:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"state left behind: {extra} (all: {state})")
        time.sleep(0.02)


def counter(peer, name: str) -> float:
    """A peer's counter (0 when never incremented)."""
    return peer.call("counters").get(name, 0.0)


def wait_counter(peer, name: str, at_least: float, timeout: float = 20.0) -> float:
    """Poll a peer's counter until it reaches ``at_least`` or ``timeout``; returns its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = counter(peer, name)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.005)


class NamedPeers:
    """Peer processes started from ``{name: PeerSpec}``, each also an attribute by its name;
    names starting with "P" are producers, with "D" decoders (for the leak check)."""

    def __init__(self, specs: dict) -> None:
        self.by_name = dict(zip(specs, start_peers(*specs.values())))
        for name, peer in self.by_name.items():
            setattr(self, name, peer)
        self.producers = [p for n, p in self.by_name.items() if n.startswith("P")]
        self.decoders = [p for n, p in self.by_name.items() if n.startswith("D")]

    def close(self) -> None:
        close_peers(*self.by_name.values())


def no_leaks_around(peers: NamedPeers):
    """Generator body of an autouse fixture: nothing held after a test that was not before."""
    before = live_state(peers.producers, peers.decoders)
    yield
    assert_no_leaks(peers.producers, peers.decoders, baseline=before)
