"""A peer server in its own OS process, driven over a pipe.

The demo, the benchmarks and the integration tests use it to run real producers and decoders as
separate processes (NIXL agents must not be created in forked children of a process that has
agents, so children are spawned). ``LocalPeer(spec)`` starts a child running a ``PeerServer``
(``peer_server``; or a subclass named ``"module:Class"``) built from ``spec``;
``LocalPeer.call(name, *args)`` runs that server's command ``name`` in the child and returns its
result (or raises ``PeerError`` with the child's traceback). ``start_pair`` starts a producer and
a decoder at once.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

DEFAULT_SERVER = "kv_push.common.testing.peer_server:PeerServer"


@dataclass
class PeerSpec:
    """What a child builds: the KV memory, the ``PushWorker`` config, its environment."""

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
    env: dict = field(default_factory=dict)  # set in the child's environment
    secret: str = field(default="", repr=False)  # the child's KV_PUSH_SECRET
    # "host": a numpy HostPool; "torch:cuda" / "torch:cpu": per-layer torch tensors (torch_pool)
    memory: str = "host"
    alloc: str = "per_layer"  # torch memory: one allocation per layer (as vLLM) or "pool"


class PeerError(RuntimeError):
    pass


def _child(conn, spec_dict: dict, server_cls: str) -> None:
    logging.basicConfig(level=os.environ.get("KV_PUSH_LOG", "WARNING"),
                        format="%(asctime)s %(processName)s %(name)s: %(message)s")
    try:
        module, _, name = server_cls.partition(":")
        server = getattr(importlib.import_module(module), name)(PeerSpec(**spec_dict))
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
            result = server.command(name)(*args, **kwargs)
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
    """A spawned child running ``server`` ("module:Class" of a ``PeerServer`` or a subclass)
    over ``spec``; waits up to ``start_timeout`` seconds for it to be ready."""

    def __init__(self, spec: PeerSpec, start_timeout: float = 60.0,
                 server: str | None = None):
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        env_backup = {k: os.environ.get(k) for k in spec.env}
        os.environ.update(spec.env)
        try:
            self.process = ctx.Process(target=_child,
                                       args=(child_conn, asdict(spec), server or DEFAULT_SERVER),
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


def start_pair(p_spec: PeerSpec, d_spec: PeerSpec, server: str | None = None,
               start_timeout: float = 120.0) -> tuple[LocalPeer, LocalPeer]:
    """Start P and D at the same time (each child allocates and touches its memory); both or
    neither."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(LocalPeer, spec, start_timeout, server) for spec in (p_spec, d_spec)]
        errors = []
        peers = []
        for f in futures:
            try:
                peers.append(f.result())
            except Exception as e:  # close the one that started
                errors.append(e)
        if errors:
            for p in peers:
                p.close()
            raise errors[0]
    return peers[0], peers[1]
