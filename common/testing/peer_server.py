"""``PeerServer``: a ``PushWorker`` over a KV memory, run in a child process, driven by commands.

A ``LocalPeer`` (``peer_process``) runs one in a spawned child and calls its commands over a pipe.
A command is a public method of the server or, when the server has none of that name, of its
memory (``command``). The server's own commands are the engine's side of a ``PushWorker``
(hand-offs, cancels, outcomes, releases, liveness, counters) plus the test hooks below; the
memory's are fill/verify commands that depend on what the KV lives in:

* ``host``: ``host_pool.HostMemory``, a numpy ``HostPool`` (``fill``/``verify`` with an exact
  random tensor, ``fill_pattern``/``verify_pattern``, canaries);
* ``torch:<device>``: ``torch_pool.TorchMemory``, per-layer torch tensors on that device, with a
  ``describe_kv_caches`` geometry and the device's backend.

A memory object has ``geometry`` (``KVGeometry``), ``backend`` (a ``KVBackend``, or None for the
worker's default) and ``close()``.

Outcomes are taken by a collector thread the moment the decoder emits them and stamped with
``time.monotonic()`` (one clock for every process on Linux), so ``outcome_at`` can time a
hand-off across processes without the pipe in it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from .peer_process import PeerSpec


def make_memory(spec: PeerSpec) -> Any:
    """The KV memory ``spec.memory`` names (see the module docstring)."""
    kind, _, device = spec.memory.partition(":")
    if kind == "host" and not device:
        from .host_pool import HostMemory
        return HostMemory(spec)
    if kind == "torch" and device:
        from .torch_pool import TorchMemory
        return TorchMemory(spec, device)
    raise ValueError(f"PeerSpec.memory {spec.memory!r}: use 'host' or 'torch:<device>'")


class PeerServer:
    """Runs in the child. Public methods (and the memory's) are the commands."""

    def __init__(self, spec: PeerSpec):
        from ..config import PushConfig
        from ..worker import PushWorker

        self.spec = spec
        self.memory = make_memory(spec)
        config = PushConfig.from_sources(
            spec.config, env={"KV_PUSH_SECRET": spec.secret} if spec.secret else {})
        self.worker = PushWorker(geometry=self.memory.geometry, role=spec.role, config=config,
                                 engine_id=spec.engine_id or None,
                                 backend=self.memory.backend).start()
        self.released: list[str] = []
        self._cond = threading.Condition()
        self._outcomes: list[tuple[str, str, str, float]] = []  # key, kind, reason, emitted at
        self._stop = threading.Event()
        if self.worker.decoder is not None:
            threading.Thread(target=self._collect, name="outcome-collector", daemon=True).start()

    def command(self, name: str) -> Callable[..., Any]:
        """The callable behind command ``name``: this server's public method, else the memory's."""
        if not name.startswith("_"):
            for owner in (self, self.memory):
                fn = getattr(owner, name, None)
                if callable(fn):
                    return fn
        raise AttributeError(f"{type(self).__name__} has no command {name!r}")

    # -- the worker ------------------------------------------------------------------------------
    def address(self):
        return self.worker.side_channel_address

    def engine_id(self):
        return self.worker.engine_id

    def geometry(self):
        return self.memory.geometry

    def live(self):
        return self.worker.live()

    def counters(self):
        return self.worker.counters.snapshot()

    def clock(self) -> float:
        return time.monotonic()

    def prefill_done(self, key, transfer_id, block_ids, num_tokens):
        self.worker.prefill_done(key, transfer_id, block_ids, num_tokens)

    def stream_prefill(self, key, transfer_id, block_ids, num_tokens, *,
                       write_layers: bool = True, delay_cycles: int = 0,
                       done: bool = True) -> int:
        """A prefill streamed layer by layer, as the connector drives it within one step:
        ``prefill_started``, per layer ``layer_saved``, ``step_saved``, then (``done``)
        ``prefill_done``. With ``write_layers`` (memories with ``hide_layers``) the request's
        blocks of every layer are zeroed first and each layer's bytes are written back right
        before its ``layer_saved`` -- as a forward writes them (CUDA: on the current stream,
        after a ``delay_cycles`` spin, so a pack not ordered after the layer's event reads
        zeros), each once the transfer thread took the previous layer in -- so a pack taken too
        early moves zeros. Returns the layers reported."""
        ids = list(block_ids)
        layers = self.memory.geometry.num_layers
        hide = getattr(self.memory, "hide_layers", None) if write_layers else None
        if hide is not None:
            hide(ids)
        self.worker.prefill_started(key, transfer_id, ids, num_tokens)
        for layer in range(layers):
            if hide is not None:
                self.memory.restore_layer(layer, delay_cycles)
            self.worker.layer_saved(layer)
            # a real layer takes far longer than the hand-over: the next starts once the
            # transfer thread took this one in
            self.worker.thread.call(lambda: None, 5.0)
        self.worker.step_saved()
        if done:
            self.worker.prefill_done(key, transfer_id, ids, num_tokens)
        return layers

    def prefill_done_at(self, key, transfer_id, block_ids, num_tokens) -> float:
        """Hand a finished prefill to the worker; returns the monotonic time of the call."""
        ids = list(block_ids)
        t0 = time.monotonic()
        self.worker.prefill_done(key, transfer_id, ids, num_tokens)
        return t0

    def expect(self, key, transfer_id, attempt, address, block_ids, first_token, num_tokens):
        self.worker.expect(key, transfer_id, attempt, tuple(address), block_ids, first_token,
                           num_tokens)

    def expect_at(self, key, transfer_id, attempt, address, block_ids, first_token,
                  num_tokens) -> float:
        """``expect``; returns the monotonic time of the call."""
        t0 = time.monotonic()
        self.worker.expect(key, transfer_id, attempt, tuple(address), block_ids, first_token,
                           num_tokens)
        return t0

    def cancel(self, key, reason="aborted"):
        self.worker.cancel(key, reason)

    # -- outcomes (decoder) ----------------------------------------------------------------------
    def _collect(self) -> None:
        """Take outcomes the moment the transfer thread emits them, and stamp them."""
        q = self.worker.decoder.outcomes
        while not self._stop.is_set():
            try:
                o = q.get(timeout=0.2)
            except queue.Empty:
                continue
            now = time.monotonic()
            with self._cond:
                self._outcomes.append((o.key, o.kind, o.reason, now))
                self._cond.notify_all()

    def _need_decoder(self, what: str) -> None:
        if self.worker.decoder is None:
            raise RuntimeError(f"{what}: this peer has no decoder (role {self.spec.role!r})")

    def outcome_at(self, key: str, timeout: float):
        """(kind, reason, monotonic time the outcome was emitted) of ``key``'s first outcome not
        yet taken, or None on time-out."""
        self._need_decoder("outcome_at")
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i, (k, kind, reason, at) in enumerate(self._outcomes):
                    if k == key:
                        del self._outcomes[i]
                        return kind, reason, at
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def wait_outcome(self, key: str, timeout: float):
        """Wait for ``key``'s outcome: (kind, reason, seconds waited) or None on time-out."""
        t0 = time.monotonic()
        got = self.outcome_at(key, timeout)
        if got is None:
            return None
        return got[0], got[1], time.monotonic() - t0

    def poll_outcomes(self) -> list[tuple[str, str, str]]:
        """Every outcome that arrived so far and was not taken, (key, kind, reason), without
        waiting."""
        self._need_decoder("poll_outcomes")
        with self._cond:
            out = [(k, kind, reason) for k, kind, reason, _ in self._outcomes]
            self._outcomes.clear()
        return out

    # -- released source blocks (producer) -------------------------------------------------------
    def wait_released(self, keys, timeout: float) -> list[str]:
        """Wait until all ``keys`` were released; returns those released so far."""
        keys = set(keys)
        t0 = time.monotonic()
        while True:
            self.released.extend(self.worker.drain_released())
            if keys <= set(self.released) or time.monotonic() - t0 > timeout:
                return [k for k in self.released if k in keys]
            time.sleep(0.0005)

    def drain_released(self):
        self.released.extend(self.worker.drain_released())
        out, self.released = self.released, []
        return out

    # -- test hooks: hostile or stale input that the normal API cannot produce ----------------
    def agent_metadata(self) -> bytes:
        """This worker's NIXL agent metadata (what a handshake would hand out)."""
        t = self.worker.thread
        return t.call(t.transport.metadata, 10.0)

    def inject(self, kind: str, fields: dict | None = None, raw: bytes | None = None,
               to_engine: str | None = None, times: int = 1) -> int:
        """Send ``messages.<kind>(**fields)`` (engine_id / tp_rank / geometry_digest default to
        this worker's, reg_id to the transfer id, prompt_digest to "", sealed for each peer as the
        transfer thread would) or ``raw`` bytes as a
        NIXL notification to every known peer (or those of engine ``to_engine``), from the
        transfer thread; ``times`` > 1 sends the very same frame again (a replay). Returns how
        many notifications went out."""
        from .. import messages as M
        t = self.worker.thread

        def send() -> int:
            msg = None
            if raw is not None:
                data = bytes(raw)
            else:
                f = {"engine_id": t.engine_id, "tp_rank": t.tp_rank, **(fields or {})}
                if kind in ("Register", "WriteDone", "Cancel", "CancelAck", "TransferFailed"):
                    f.setdefault("reg_id", f.get("transfer_id", ""))
                if kind in ("Register", "Cancel"):
                    f.setdefault("prompt_digest", "")
                if kind == "Register":
                    f.setdefault("geometry_digest", M.geometry_digest(t.geometry))
                    f["block_ids"] = tuple(int(b) for b in f["block_ids"])
                msg = getattr(M, kind)(**f)
            sent = 0
            for name, peer in list(t.peers.items()):
                if to_engine is None or peer.engine_id == to_engine:
                    frame = data if msg is None else t.seal(name, msg)
                    for _ in range(times):
                        sent += bool(t.transport.send_notif(name, frame))
            return sent
        return t.call(send, 10.0)

    def notify_unknown(self, metadata: bytes, payloads) -> str:
        """Load another agent's metadata into this worker's NIXL agent without a handshake (that
        agent never learns who we are) and send it ``payloads`` as raw notifications."""
        t = self.worker.thread

        def go() -> str:
            name = t.transport.add_peer(bytes(metadata))
            for data in payloads:
                t.transport.send_notif(name, bytes(data))
            return name
        return t.call(go, 10.0)

    # -- shutdown --------------------------------------------------------------------------------
    def quiet(self) -> None:
        """Before a planned shutdown: the peer's goodbye is expected, not worth a warning."""
        logging.getLogger("kv_push.common.transfer_thread").setLevel(logging.ERROR)

    def close(self):
        self._stop.set()
        self.worker.close()
        self.memory.close()
        return True
