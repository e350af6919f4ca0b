"""In-memory stand-ins shared by the tests: no NIXL, no threads of their own.

* ``Wire`` and ``FakeTransport``: the ``Transport`` seam in memory. Notifications are queues by
  agent name; a WRITE moves no bytes but delivers its notification. Knobs make the WRITE path
  misbehave on purpose: ``hold_writes`` (WRITEs stay "PROC" until ``finish``), ``fail_posts``
  (the next posts fail: a handle that polls "ERR"), ``raise_on_write`` (a post that raises,
  breaking the seam's contract). Everything it was asked to do is recorded.
* ``FakeClock``: a settable clock for ``TransferThread``/``Rendezvous``.
* ``InlineExecutor`` / ``ManualExecutor``: run the decoder's handshakes now, or when the test says.
* ``Node``: one worker's ``TransferThread`` that is never started, on a ``FakeTransport`` and a
  shared ``FakeClock``; the test advances it with ``step()``. It is the roles' ``RoleContext``.
* ``RawEnd``: the other side of a test, driven by hand: a ``FakeTransport`` plus a codec, no
  thread, no role (the test is its owner).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Callable

from kv_push.common.config import PushConfig
from kv_push.common.geometry import KVGeometry
from kv_push.common.messages import Codec, Heartbeat
from kv_push.common.metrics import Counters
from kv_push.common.transfer_thread import TransferThread
from kv_push.common.transport import TransportError


class Wire:
    """Notification queues by agent name, shared by the fake transports of one test."""

    def __init__(self) -> None:
        self.queues: dict[str, queue.SimpleQueue] = {}

    def inject(self, to: str, sender: str, data: bytes) -> None:
        self.queues[to].put((sender, data))

    def idle(self) -> bool:
        return all(q.empty() for q in self.queues.values())


@dataclass(eq=False)
class FakeHandle:
    peer: str
    state: str  # "PROC" | "DONE" | "ERR"
    notif: bytes = b""
    src: Any = None
    dst: Any = None
    reason: str = ""
    released: bool = False
    released_state: str = ""  # the state it had when released


class FakeTransport:
    """``Transport`` in memory. Records which threads call it and what it was asked to do."""

    def __init__(self, wire: Wire, name: str):
        self.wire = wire
        self.agent_name = name
        self.nixl_version = ""  # no NIXL under it: peers on fakes pair with each other
        self.first_call_waits_for_peer = False
        wire.queues[name] = queue.SimpleQueue()
        self.peers: set[str] = set()
        self.removed: list[str] = []
        self.registered: list[tuple] = []
        self.closed = False
        self.callers: set[int] = set()
        self.writes: list[FakeHandle] = []  # every WRITE asked for, in order
        self.sent: list[tuple[str, bytes]] = []  # every notification posted
        self.hold_writes = False
        self.fail_posts: list[str] = []  # reasons for the next posts to fail, in order
        self.raise_on_write: BaseException | None = None

    def _called(self) -> None:
        self.callers.add(threading.get_ident())
        assert not self.closed, "transport used after close"

    def register(self, regions, mem_type, dev_id) -> None:
        self._called()
        self.registered.append((tuple(regions), mem_type, dev_id))

    def metadata(self) -> bytes:
        self._called()
        return b"meta:" + self.agent_name.encode()

    def add_peer(self, metadata: bytes) -> str:
        self._called()
        if not metadata.startswith(b"meta:"):
            raise TransportError("bad metadata")
        name = metadata[5:].decode()
        self.peers.add(name)
        return name

    def remove_peer(self, peer: str) -> None:
        self._called()
        self.removed.append(peer)
        self.peers.discard(peer)

    def write(self, peer, src, dst, src_mem, dst_mem, notif) -> FakeHandle:
        self._called()
        if self.raise_on_write is not None:
            exc, self.raise_on_write = self.raise_on_write, None
            raise exc
        handle = FakeHandle(peer, "PROC", bytes(notif), src, dst)
        self.writes.append(handle)
        if peer not in self.peers:
            handle.state, handle.reason = "ERR", f"unknown peer {peer}"
        elif self.fail_posts:
            handle.state, handle.reason = "ERR", self.fail_posts.pop(0)
        elif not self.hold_writes:
            self.finish(handle)
        return handle

    read = write

    def finish(self, handle: FakeHandle, error: str = "") -> None:
        """Complete a WRITE in flight: DONE (its notification is delivered) or ERR (``error``)."""
        assert handle.state == "PROC", handle
        if error:
            handle.state, handle.reason = "ERR", error
            return
        handle.state = "DONE"
        if handle.peer in self.wire.queues:
            self.wire.inject(handle.peer, self.agent_name, handle.notif)

    def in_flight(self) -> list[FakeHandle]:
        return [h for h in self.writes if h.state == "PROC"]

    def poll(self, handle: FakeHandle) -> str:
        self._called()
        return handle.state

    def release(self, handle: FakeHandle) -> None:
        self._called()
        handle.released, handle.released_state = True, handle.state

    @staticmethod
    def failure_reason(handle: FakeHandle) -> str:
        return handle.reason or "transfer reported ERR"

    def send_notif(self, peer: str, data: bytes) -> bool:
        self._called()
        if peer not in self.peers or peer not in self.wire.queues:
            return False
        self.sent.append((peer, bytes(data)))
        self.wire.inject(peer, self.agent_name, bytes(data))
        return True

    def get_notifs(self) -> list[tuple[str, bytes]]:
        self._called()
        out = []
        q = self.wire.queues[self.agent_name]
        while True:
            try:
                out.append(q.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._called()
        self.closed = True


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class InlineExecutor(Executor):
    """Runs what is submitted at once, on the caller's thread."""

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed back through the future
            fut.set_exception(e)
        return fut


class ManualExecutor(Executor):
    """Holds what is submitted until ``run()`` (a handshake in progress, for as long as needed)."""

    def __init__(self) -> None:
        self.jobs: list[Callable[[], Any]] = []

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        self.jobs.append(lambda: fn(*args, **kwargs))
        return Future()

    def run(self) -> int:
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job()
        return len(jobs)


def role_config(**kw) -> PushConfig:
    """A config for in-process role tests: liveness so slow (time-out 1500 s of fake time) that
    only a test about it sees a peer declared dead for silence."""
    kw.setdefault("heartbeat_interval_s", 1000.0)
    return PushConfig(**kw).validate()


class Node:
    """One worker's transfer thread, never started: ``step()`` runs one pass of its loop."""

    def __init__(self, wire: Wire, clock: FakeClock, name: str, geometry: KVGeometry,
                 config: PushConfig, engine_id: str | None = None):
        self.transport = FakeTransport(wire, name)
        self.counters = Counters()
        self.thread = TransferThread(self.transport, engine_id=engine_id or name,
                                     tp_rank=geometry.tp_rank, geometry=geometry, config=config,
                                     counters=self.counters, clock=clock)

    @property
    def name(self) -> str:
        return self.transport.agent_name

    def step(self, times: int = 1) -> None:
        for _ in range(times):
            self.thread.step()

    def count(self, name: str, label: str | None = None) -> float:
        return self.counters.get(name, label=label)


def settle(*nodes: Node, wire: Wire, max_rounds: int = 100) -> None:
    """Step every node until nothing is on the wire for three rounds in a row (work a step
    submits runs in the next one, so chains of up to three submissions settle too)."""
    quiet = 0
    for _ in range(max_rounds):
        for node in nodes:
            node.step()
        quiet = quiet + 1 if wire.idle() else 0
        if quiet >= 3:
            return
    raise AssertionError(f"nodes did not settle within {max_rounds} rounds")


class RawEnd:
    """One side of a test driven by hand: a transport and a codec, no thread, no role."""

    def __init__(self, wire: Wire, name: str, codec: Codec | None = None):
        self.transport = FakeTransport(wire, name)
        self.codec = codec or Codec()

    @property
    def name(self) -> str:
        return self.transport.agent_name

    def meet(self, other_name: str) -> None:
        self.transport.add_peer(b"meta:" + other_name.encode())

    def send(self, to: str, msg) -> None:
        assert self.transport.send_notif(to, self.codec.encode(msg)), f"{to} is not a peer"

    def received(self, *, heartbeats: bool = False) -> list:
        """Messages that arrived since the last call, decoded (heartbeats left out)."""
        out = [self.codec.decode(data) for _, data in self.transport.get_notifs()]
        return out if heartbeats else [m for m in out if not isinstance(m, Heartbeat)]
