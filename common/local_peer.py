"""A ``PushWorker`` over a synthetic host pool in its own OS process, driven over a pipe.

The demo, the benchmarks and the integration tests use it to run real producers and decoders as
separate processes (NIXL agents must not be created in forked children of a process that has
agents, so children are spawned). ``LocalPeer.call(name, *args)`` runs ``PeerServer.<name>`` in
the child and returns its result (or raises ``PeerError`` with the child's traceback).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class PeerSpec:
    role: str  # producer | decoder | both
    placement: str = "kv_split"
    num_layers: int = 4
    num_kv_heads: int = 4
    head_size: int = 16
    dtype_bytes: int = 2
    block_size: int = 16
    num_blocks: int = 256
    tp_size: int = 1
    tp_rank: int = 0
    token_order: str = "NHD"
    engine_id: str = ""
    config: dict = field(default_factory=dict)  # PushConfig fields
    env: dict = field(default_factory=dict)


class PeerError(RuntimeError):
    pass


class PeerServer:
    """Runs in the child. Public methods are the commands."""

    def __init__(self, spec: PeerSpec):
        from .config import PushConfig
        from .synthetic_kv import HostPool
        from .worker import PushWorker

        self.spec = spec
        self.pool = HostPool(placement=spec.placement, num_layers=spec.num_layers,
                             num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                             dtype_bytes=spec.dtype_bytes, block_size=spec.block_size,
                             num_blocks=spec.num_blocks, tp_size=spec.tp_size,
                             tp_rank=spec.tp_rank, token_order=spec.token_order)  # type: ignore[arg-type]
        config = PushConfig.from_sources(spec.config, env={})
        self.worker = PushWorker(geometry=self.pool.geometry, role=spec.role, config=config,
                                 engine_id=spec.engine_id or None).start()
        self.outcomes: dict[str, Any] = {}
        self.released: list[str] = []

    def address(self):
        return self.worker.side_channel_address

    def engine_id(self):
        return self.worker.engine_id

    def fill(self, seed: int, num_tokens: int, block_ids, first_token: int = 0):
        from .synthetic_kv import logical_kv
        g = self.pool.geometry
        logical = logical_kv(seed, num_layers=g.num_layers, num_tokens=num_tokens,
                             num_kv_heads=g.num_kv_heads, vec_bytes=g.vec_bytes, kv_parts=g.kv_parts)
        self.pool.scatter(logical, block_ids, first_token)

    def fill_byte(self, value: int):
        self.pool.buf.fill(value)

    def verify(self, seed: int, num_tokens: int, block_ids, first_token: int) -> int:
        """Number of bytes in ``block_ids`` that differ from the logical KV (0 = correct)."""
        from .synthetic_kv import logical_kv
        g = self.pool.geometry
        logical = logical_kv(seed, num_layers=g.num_layers, num_tokens=num_tokens,
                             num_kv_heads=g.num_kv_heads, vec_bytes=g.vec_bytes, kv_parts=g.kv_parts)
        lo, hi = g.head_range
        want = logical[:, :, first_token:num_tokens, lo:hi]
        got = self.pool.gather(block_ids, first_token, num_tokens)
        return int(np.count_nonzero(got != want))

    def block_bytes_equal(self, block_ids, value: int) -> bool:
        """True if every byte of these blocks (all layers, K and V) equals ``value``."""
        g = self.pool.geometry
        for b in block_ids:
            for bases in g.part_bases:
                for base in bases:
                    off = base - self.pool.base + b * g.block_stride
                    if np.any(self.pool.buf[off: off + g.block_bytes] != value):
                        return False
        return True

    def fill_blocks(self, block_ids, value: int):
        """Set every byte of these blocks (all layers, K and V) to ``value`` (a canary)."""
        g = self.pool.geometry
        for b in block_ids:
            for bases in g.part_bases:
                for base in bases:
                    off = base - self.pool.base + b * g.block_stride
                    self.pool.buf[off: off + g.block_bytes] = value

    # -- test hooks: hostile or stale input that the normal API cannot produce ----------------
    def agent_metadata(self) -> bytes:
        """This worker's NIXL agent metadata (what a handshake would hand out)."""
        t = self.worker.thread
        return t.call(t.transport.metadata, 10.0)

    def inject(self, kind: str, fields: dict | None = None, raw: bytes | None = None,
               to_engine: str | None = None) -> int:
        """Send ``messages.<kind>(**fields)`` (engine_id / tp_rank / geometry_digest default to
        this worker's, reg_id to the transfer id, prompt_digest to "") or ``raw`` bytes as a NIXL notification to every known peer (or those of
        engine ``to_engine``), from the transfer thread. Returns how many peers it went to."""
        from . import messages as M
        t = self.worker.thread

        def send() -> int:
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
                data = t.codec.encode(getattr(M, kind)(**f))
            sent = 0
            for name, peer in list(t.peers.items()):
                if to_engine is None or peer.engine_id == to_engine:
                    sent += bool(t.transport.send_notif(name, data))
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

    def poll_outcomes(self) -> list[tuple[str, str, str]]:
        """Every outcome that arrived so far, (key, kind, reason), without waiting."""
        out = [(k, kind, reason) for k, (kind, reason) in self.outcomes.items()]
        self.outcomes.clear()
        out.extend((o.key, o.kind, o.reason) for o in self.worker.drain_outcomes())
        return out

    def prefill_done(self, key, transfer_id, block_ids, num_tokens):
        self.worker.prefill_done(key, transfer_id, block_ids, num_tokens)

    def expect(self, key, transfer_id, attempt, address, block_ids, first_token, num_tokens):
        self.worker.expect(key, transfer_id, attempt, tuple(address), block_ids, first_token,
                           num_tokens)

    def cancel(self, key, reason="aborted"):
        self.worker.cancel(key, reason)

    def wait_outcome(self, key: str, timeout: float):
        """Wait for ``key``'s outcome: (kind, reason, seconds waited) or None on time-out."""
        t0 = time.monotonic()
        while key not in self.outcomes:
            for o in self.worker.drain_outcomes():
                self.outcomes[o.key] = (o.kind, o.reason)
            if key in self.outcomes:
                break
            if time.monotonic() - t0 > timeout:
                return None
            time.sleep(0.0002)
        kind, reason = self.outcomes.pop(key)
        return kind, reason, time.monotonic() - t0

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

    def live(self):
        return self.worker.live()

    def counters(self):
        return self.worker.counters.snapshot()

    def geometry(self):
        return self.pool.geometry

    def close(self):
        self.worker.close()
        return True


def _child(conn, spec_dict: dict, server_cls: str | None = None) -> None:
    logging.basicConfig(level=os.environ.get("KV_PUSH_LOG", "WARNING"),
                        format="%(asctime)s %(processName)s %(name)s: %(message)s")
    try:
        cls = PeerServer
        if server_cls:  # "module:Class", a PeerServer subclass with more commands
            module, _, name = server_cls.partition(":")
            cls = getattr(importlib.import_module(module), name)
        server = cls(PeerSpec(**spec_dict))
        conn.send(("ok", None))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            name, args, kwargs = conn.recv()
        except EOFError:
            break
        try:
            result = getattr(server, name)(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
        if name == "close":
            # the worker is closed (transfer thread joined, agent released): skip the
            # interpreter's finalisation, which takes 1-3 s with NIXL and UCX loaded
            logging.shutdown()
            conn.close()
            os._exit(0)


class LocalPeer:
    """``server``: optional "module:Class" of a ``PeerServer`` subclass to run in the child."""

    def __init__(self, spec: PeerSpec, start_timeout: float = 60.0, server: str | None = None):
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        env_backup = {k: os.environ.get(k) for k in spec.env}
        os.environ.update(spec.env)
        try:
            self.process = ctx.Process(target=_child, args=(child_conn, asdict(spec), server),
                                       name=f"kvpush-{spec.role}-r{spec.tp_rank}", daemon=True)
            self.process.start()
        finally:
            for k, v in env_backup.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.spec = spec
        self._recv(start_timeout)

    def _recv(self, timeout: float):
        deadline = time.monotonic() + timeout
        while not self._conn.poll(min(0.1, max(0.0, deadline - time.monotonic()))):
            if not self.process.is_alive():  # died (crash, kill -9): do not wait out the time-out
                raise PeerError(f"peer {self.spec.role} exited with code {self.process.exitcode}")
            if time.monotonic() >= deadline:
                raise PeerError(f"peer {self.spec.role} did not answer within {timeout}s")
        status, payload = self._conn.recv()
        if status == "err":
            raise PeerError(payload)
        return payload

    def call(self, name: str, *args, timeout: float = 120.0, **kwargs):
        self._conn.send((name, args, kwargs))
        return self._recv(timeout)

    def kill(self) -> None:
        """kill -9: no goodbye, no clean-up."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("close", timeout=15)
            except (PeerError, OSError, EOFError):
                pass
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
