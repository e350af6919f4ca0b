#!/usr/bin/env python
"""Push vs pull on one GPU: real VRAM -> VRAM through NIXL UCX (cuda_ipc), two processes.

The GPU counterpart of ``bench_transfer.py``. P (producer) and D (decoder) are two spawned
processes on the same GPU (``cuda:0``). Each allocates vLLM-FlashAttention-shaped KV: per layer
one tensor ``(2, num_blocks, block_size, kv_heads, head_size)`` bf16 (``kv_split``; the test also
uses ``(num_blocks, 2, ...)``, ``blocks_first``, and head-major permuted views), describes it
with ``describe_kv_caches(..., backend=CudaBackend())`` and runs a real ``PushWorker`` over it --
the production code path: side-channel handshake, registration notification, rendezvous,
``plan_writes``, one NIXL WRITE with the ``WriteDone`` notification, release.

P fills its blocks with a deterministic function of (seed, layer, K/V, token, global head,
element) computed on the GPU (bf16 bit patterns); D fills its whole pool with a canary before
every transfer and afterwards checks on the GPU that every received (layer, K/V, token, head)
vector equals the function and that every byte outside the target tokens still holds the
canary. Only two counts come back to the host.

Methods, per case (interleaved, order rotating, every transfer verified):

* push        -- D registered earlier; from P's ``prefill_done`` call to D's ``received``
                 outcome (``time.monotonic`` stamps inside the children: one clock);
* pull        -- vLLM NixlConnector-style: P's block ids reach D by one localhost HTTP request
                 (the relay hop), D builds one descriptor per (layer, K/V, block) on each side
                 and posts a NIXL READ carrying a notification to P; from P's prefill-done to
                 the later of "D's READ is DONE" and "P got the notification";
* bare_write  -- the push plan's regions as one WRITE, request built in advance, post + poll.

Pull and bare transfers use a second NIXL agent per process (``bench_peer.AgentThread``) over
the same registered memory.

    UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y python benchmarks/bench_transfer_gpu.py   # H200: full run
    python benchmarks/bench_transfer_gpu.py --device cpu --layers 4 --tokens 256,1024 --reps 2
                                                                   # host tensors, to debug

Writes ``benchmarks/results/transfer_gpu.json`` and ``transfer_gpu.md`` (``--out-dir``).

On a GPU without active NVLinks (one GPU in a VM, PCIe cards) UCX disables cuda_ipc GET by
default, so pull's READ falls back to a path of ~0.4 GB/s while WRITE uses cuda_ipc; set
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` for a like-for-like pull baseline (see docs/gpu.md).
``--alloc pool`` puts all layers in one allocation instead of one per layer (as vLLM does).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # spawned children import this module (and bench_peer)

from bench_peer import AgentThread, PullPeer  # noqa: E402
from kv_push.common.demo import start_pair  # noqa: E402
from kv_push.common.layout import plan_writes  # noqa: E402
from kv_push.common.local_peer import PeerError, PeerSpec  # noqa: E402
from kv_push.common.synthetic_kv import fragmented_blocks  # noqa: E402

SERVER = "bench_transfer_gpu:GpuPeerServer"
DEVICE_ENV = "KV_PUSH_BENCH_DEVICE"  # "cuda" (default) or "cpu" (host tensors, HostBackend)
ALLOC_ENV = "KV_PUSH_BENCH_ALLOC"  # "per_layer" (default, as vLLM) or "pool" (one allocation)
METHODS = ("push", "pull", "bare_write")
QWEN3_32B = dict(num_layers=64, num_kv_heads=8, head_size=128, dtype_bytes=2)
CANARY_D = 0x5A5A  # int16 bit pattern D's pool holds before every transfer
CANARY_P = 0x3C3C  # P's blocks outside the prompt
_M32 = 0xFFFFFFFF


# -- the KV pattern ------------------------------------------------------------------------------

def _lk_key(seed: int, layer: int, kv: int) -> int:
    """A 32-bit key per (request seed, layer, K/V), mixed on the host."""
    x = (seed * 0x9E3779B1 + layer * 0x85EBCA77 + kv * 0xC2B2AE3D + 0x27D4EB2F) & _M32
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & _M32
    x ^= x >> 12
    return x


class Pattern:
    """``value(layer, kv, token, head, element)`` as int16 bit patterns, computed on the device.

    A per-(token, global head, element) 32-bit hash (cached per token range) is combined with a
    per-(seed, layer, K/V) key and mixed again, so every element of every vector differs from
    its neighbours and from other layers, K/V and requests.
    """

    def __init__(self, torch, device, head_lo: int, heads: int, head_size: int):
        self.torch, self.device = torch, device
        self.head_lo, self.heads, self.head_size = head_lo, heads, head_size
        self._base: dict[tuple[int, int], Any] = {}

    def _base_for(self, t0: int, t1: int):
        key = (t0, t1)
        if key not in self._base:
            torch = self.torch
            if len(self._base) > 4:
                self._base.clear()
            t = torch.arange(t0, t1, device=self.device, dtype=torch.int64).view(-1, 1, 1)
            h = torch.arange(self.head_lo, self.head_lo + self.heads, device=self.device,
                             dtype=torch.int64).view(1, -1, 1)
            e = torch.arange(self.head_size, device=self.device, dtype=torch.int64).view(1, 1, -1)
            x = (t * 4096 + h) * 4096 + e  # distinct per (token, head, element); < 2^48
            lo, hi = x & _M32, x >> 32
            x = (lo * 0x2545F491 + hi * 0x1B873593 + 0x165667B1) & _M32
            x = x ^ (x >> 16)
            self._base[key] = x
        return self._base[key]

    def values(self, seed: int, layer: int, kv: int, t0: int, t1: int):
        """int16 tensor (t1 - t0, heads, head_size) on the device."""
        torch = self.torch
        x = self._base_for(t0, t1) ^ _lk_key(seed, layer, kv)
        x = (x * 0x045D9F3B) & _M32
        x = (x ^ (x >> 16)) & 0xFFFF
        return (x - ((x >> 15) << 16)).to(torch.int16)


def _as_i16(value: int) -> int:
    return value - 0x10000 if value >= 0x8000 else value


# -- the peer (runs in a spawned child) ----------------------------------------------------------

class GpuPeerServer(PullPeer):
    """A ``PushWorker`` over per-layer torch KV tensors, plus a pull/bare NIXL agent.

    Constructed by ``kv_push.common.demo``'s child loop from a ``PeerSpec`` (placement
    ``kv_split`` or ``blocks_first``, token order NHD or HND); public methods are the commands.
    """

    def __init__(self, spec: PeerSpec):
        import torch

        from kv_push.common.backend import HostBackend, describe_kv_caches
        from kv_push.common.config import PushConfig
        from kv_push.common.worker import PushWorker

        self.torch = torch
        self.spec = spec
        dev_name = os.environ.get(DEVICE_ENV, "cuda")
        if dev_name == "cuda":
            from kv_push.gpu_push.backend import CudaBackend
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
            backend: Any = CudaBackend()
        else:
            self.device = torch.device("cpu")
            backend = HostBackend()
        self.backend_name = backend.name
        local_heads = max(1, spec.num_kv_heads // spec.tp_size)
        nb, bs, d = spec.num_blocks, spec.block_size, spec.head_size
        if spec.dtype_bytes != 2:
            raise ValueError("this peer allocates bf16 KV (dtype_bytes 2)")
        # vLLM FlashAttention: (2, num_blocks, block_size, heads, head_size) per layer; an HND
        # backend's cache is allocated head-major and handed over as a permuted view
        if spec.placement == "kv_split":
            dims = "2BTHD"
            phys = (2, nb, bs, local_heads, d) if spec.token_order == "NHD" else \
                (2, nb, local_heads, bs, d)
        elif spec.placement == "blocks_first":
            dims = "B2THD"
            phys = (nb, 2, bs, local_heads, d) if spec.token_order == "NHD" else \
                (nb, 2, local_heads, bs, d)
        else:
            raise ValueError(f"placement {spec.placement!r} not supported here")
        # "per_layer" (vLLM: one allocation per layer) or "pool" (one allocation, layer views)
        self.alloc = os.environ.get(ALLOC_ENV, "per_layer")
        if self.alloc == "pool":
            pool = torch.empty((spec.num_layers, *phys), dtype=torch.bfloat16, device=self.device)
            raw = [pool[i] for i in range(spec.num_layers)]
        elif self.alloc == "per_layer":
            raw = [torch.empty(phys, dtype=torch.bfloat16, device=self.device)
                   for _ in range(spec.num_layers)]
        else:
            raise ValueError(f"{ALLOC_ENV}={self.alloc!r}: use per_layer or pool")
        # an HND backend's cache is head-major; the connector gets the logical permuted view
        self.layers = [t.transpose(-3, -2) if spec.token_order == "HND" else t for t in raw]
        self._dims = dims
        self.geometry = describe_kv_caches(
            self.layers, backend=backend, num_kv_heads=spec.num_kv_heads, head_size=d,
            block_size=bs, tp_size=spec.tp_size, tp_rank=spec.tp_rank, dtype="bfloat16",
            dims=dims)
        g = self.geometry
        self.pattern = Pattern(torch, self.device, g.head_range[0], g.local_heads, d)
        config = PushConfig.from_sources(spec.config, env={})
        self.worker = PushWorker(geometry=g, role=spec.role, config=config,
                                 engine_id=spec.engine_id or None, backend=backend).start()
        self._cond = threading.Condition()
        self._stamped: dict[str, tuple[str, str, float]] = {}
        self._released: list[str] = []
        self._stop = threading.Event()
        if self.worker.decoder is not None:
            threading.Thread(target=self._collect, name="outcome-collector", daemon=True).start()
        # the pull / bare agent (created lazily: the correctness test does not need it)
        self.agent = None
        self._pull_init()
        self._bare: dict[str, Any] = {}

    # -- memory views --------------------------------------------------------------------------
    def _part(self, layer: int, kv: int):
        """int16 view (num_blocks, block_size, heads, head_size) of one layer's K or V."""
        t = self.layers[layer].view(self.torch.int16)
        return t[kv] if self._dims == "2BTHD" else t[:, kv]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _ids(self, block_ids):
        return self.torch.as_tensor([int(b) for b in block_ids], dtype=self.torch.int64,
                                    device=self.device)

    def info(self) -> dict:
        torch = self.torch
        out = {"backend": self.backend_name, "device": str(self.device), "torch": torch.__version__,
               "alloc": self.alloc,
               "regions_registered": len(self.geometry.regions()),
               "tensor_shape": tuple(self.layers[0].shape),
               "tensor_stride": tuple(self.layers[0].stride())}
        if self.device.type == "cuda":
            out["gpu"] = torch.cuda.get_device_name(self.device)
            out["cuda"] = torch.version.cuda
            out["allocations"], out["regions_crossing_allocations"] = self._allocation_check()
        return out

    def _allocation_check(self) -> tuple[int, list]:
        """(distinct CUDA allocations under the KV tensors, registered regions that extend past
        the allocation holding their first byte) -- such a region cannot be one CUDA IPC handle."""
        import ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                       ctypes.c_uint64]

        def alloc_of(addr: int) -> tuple[int, int]:
            base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
            if fn(ctypes.byref(base), ctypes.byref(size), addr) != 0:
                return (0, 0)
            return base.value, size.value

        allocs = {alloc_of(int(t.data_ptr())) for t in self.layers}
        crossing = []
        for start, length in self.geometry.regions():
            base, size = alloc_of(start)
            if start + length > base + size:
                crossing.append({"region": [start, length], "allocation": [base, size],
                                 "allocations_spanned": sum(start <= a < start + length
                                                            for a, _ in allocs)})
        return len(allocs), crossing

    # -- pattern fill / verify (on the device) ----------------------------------------------------
    def fill(self, seed: int, num_tokens: int, block_ids, first_token: int = 0) -> None:
        """P: every byte of the pool to CANARY_P, then tokens [first_token, num_tokens) of
        request ``seed`` into ``block_ids`` (block j holds tokens first_token + j*block_size...)."""
        g = self.geometry
        bs = g.block_size
        n = num_tokens - first_token
        nb = -(-n // bs)
        ids = self._ids(list(block_ids)[:nb])
        for t in self.layers:
            t.view(self.torch.int16).fill_(_as_i16(CANARY_P))
        for layer in range(g.num_layers):
            for kv in range(g.kv_parts):
                vals = self.pattern.values(seed, layer, kv, first_token, first_token + nb * bs)
                self._part(layer, kv)[ids] = vals.view(nb, bs, g.local_heads, g.head_size)
        self._sync()

    def canary(self) -> None:
        """D: every byte of the pool to CANARY_D."""
        for t in self.layers:
            t.view(self.torch.int16).fill_(_as_i16(CANARY_D))
        self._sync()

    def verify(self, seed: int, num_tokens: int, block_ids, first_token: int = 0,
               whole_blocks: bool = False) -> dict:
        """D: elements of tokens [first_token, num_tokens) in ``block_ids`` that differ from the
        pattern (``mismatch``), and elements outside them that lost the canary (``canary``).
        ``whole_blocks``: the method copies whole blocks (pull), so the last block's slots past
        ``num_tokens`` may hold the source's bytes and are not checked."""
        torch = self.torch
        g = self.geometry
        bs = g.block_size
        n = num_tokens - first_token
        nb = -(-n // bs)
        target = [int(b) for b in block_ids][:nb]
        ids = self._ids(target)
        tset = set(target)
        others = self._ids([b for b in range(g.num_blocks) if b not in tset])
        tail = 0 if whole_blocks else nb * bs - n  # slots of the last block past num_tokens
        bad = torch.zeros((), dtype=torch.int64, device=self.device)
        lost = torch.zeros((), dtype=torch.int64, device=self.device)
        c = _as_i16(CANARY_D)
        for layer in range(g.num_layers):
            for kv in range(g.kv_parts):
                part = self._part(layer, kv)
                got = part[ids].reshape(nb * bs, g.local_heads, g.head_size)[:n]
                want = self.pattern.values(seed, layer, kv, first_token, num_tokens)
                bad += (got != want).sum()
                if others.numel():
                    lost += (part[others] != c).sum()
                if tail:
                    lost += (part[target[-1], bs - tail:] != c).sum()
        self._sync()
        elems = g.num_layers * g.kv_parts * n * g.local_heads * g.head_size
        return {"mismatch": int(bad.item()), "canary": int(lost.item()),
                "checked_bytes": elems * 2}

    def copy_rate(self, nbytes: int, reps: int = 5) -> float:
        """GB/s of one contiguous device-to-device ``copy_`` of ``nbytes`` (the ceiling)."""
        torch = self.torch
        a = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        b = torch.empty_like(a)
        times = []
        for _ in range(reps + 1):
            self._sync()
            t = time.perf_counter()
            b.copy_(a)
            self._sync()
            times.append(time.perf_counter() - t)
        del a, b
        return nbytes / statistics.median(times[1:]) / 1e9

    # -- push (the production path) ----------------------------------------------------------------
    def _collect(self) -> None:
        import queue
        q = self.worker.decoder.outcomes
        while not self._stop.is_set():
            try:
                o = q.get(timeout=0.2)
            except queue.Empty:
                continue
            now = time.monotonic()
            with self._cond:
                self._stamped[o.key] = (o.kind, o.reason, now)
                self._cond.notify_all()

    def address(self):
        return self.worker.side_channel_address

    def engine_id(self) -> str:
        return self.worker.engine_id

    def geometry_(self):
        return self.geometry

    def counters(self) -> dict:
        return self.worker.counters.snapshot()

    def live(self) -> dict:
        return self.worker.live()

    def expect_at(self, key, transfer_id, attempt, address, block_ids, first_token,
                  num_tokens) -> float:
        t0 = time.monotonic()
        self.worker.expect(key, transfer_id, attempt, tuple(address), list(block_ids),
                           first_token, num_tokens)
        return t0

    def prefill_done_at(self, key, transfer_id, block_ids, num_tokens) -> float:
        ids = list(block_ids)
        t0 = time.monotonic()
        self.worker.prefill_done(key, transfer_id, ids, num_tokens)
        return t0

    def outcome_at(self, key: str, timeout: float):
        """(kind, reason, monotonic time D's outcome was emitted) or None on time-out."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._stamped:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._stamped.pop(key)

    def wait_released(self, keys, timeout: float) -> list[str]:
        keys = set(keys)
        deadline = time.monotonic() + timeout
        while True:
            self._released.extend(self.worker.drain_released())
            if keys <= set(self._released) or time.monotonic() > deadline:
                got = [k for k in self._released if k in keys]
                self._released = [k for k in self._released if k not in keys]
                return got
            time.sleep(0.0005)

    # -- the second agent: pull and bare transfers ---------------------------------------------------
    def _agent(self):
        if self.agent is None:
            g = self.geometry
            self.agent = AgentThread(f"gpubench-{self.spec.role}-{self.worker.engine_id[:8]}")
            self.agent.call(lambda: self.agent.transport.register(g.regions(), g.mem_type,
                                                                  g.dev_id))
        return self.agent

    def _pull_agent(self):
        return self._agent()

    def _pull_geometry(self):
        return self.geometry

    def progress(self, on: bool) -> None:
        """Keep the agent polled (the target of a bare transfer; P while a pull is in flight)."""
        self._progress = on
        if on:
            self.agent.call(self._ensure_watch)

    # bare WRITE (P side): the push plan's regions, request built in advance
    def bare_prepare(self, src_blocks, dst_blocks, num_tokens: int) -> dict:
        a = self._agent()
        g, rg = self.geometry, self.remote_geo

        def build():
            t0 = time.monotonic()
            plan = plan_writes(g, src_blocks, rg, dst_blocks, first_token=0,
                               num_tokens=num_tokens)
            local, remote = plan.descs("src", g.dev_id), plan.descs("dst", rg.dev_id)
            t1 = time.monotonic()
            ag = a.transport._agent
            ld = ag.get_xfer_descs(local, g.mem_type)
            rd = ag.get_xfer_descs(remote, rg.mem_type)
            t2 = time.monotonic()
            handle = ag.initialize_xfer("WRITE", ld, rd, self.remote_peer, b"")
            t3 = time.monotonic()
            self._bare["WRITE"] = handle
            return {"descs": int(local.shape[0]), "plan_s": t1 - t0, "dlist_s": t2 - t1,
                    "init_s": t3 - t2}
        return a.call(build)

    def bare_run(self) -> dict:
        a = self.agent
        handle = self._bare["WRITE"]

        def run():
            ag = a.transport._agent
            t0 = time.monotonic()
            state = ag.transfer(handle)
            t1 = time.monotonic()
            while state == "PROC":
                state = ag.check_xfer_state(handle)
            t2 = time.monotonic()
            return {"start": t0, "posted": t1, "done": t2, "state": state}
        return a.call(run, 80.0)

    def bare_release(self) -> None:
        handle = self._bare.pop("WRITE", None)
        if handle is not None:
            a = self.agent
            a.call(lambda: a.transport._agent.release_xfer_handle(handle))

    def close(self):
        self._stop.set()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._client is not None:
            self._client.close()
        if self.agent is not None:
            self.agent.close()
        self.worker.close()
        return True


# -- the parent ----------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(msg, flush=True)


def per_token_bytes(a) -> int:
    return a.layers * 2 * a.kv_heads * a.head_size * 2


def pool_blocks(tokens: int, bs: int, slack: float) -> int:
    return int(math.ceil(-(-tokens // bs) * slack)) + 2


def wait_counter(peer, name: str, target: float, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while peer.call("counters").get(name, 0) < target:
        if time.monotonic() > deadline:
            raise PeerError(f"counter {name} never reached {target}")
        time.sleep(0.001)


def start_gpu_pair(p_spec: PeerSpec, d_spec: PeerSpec, device: str, server: str = SERVER):
    """P and D children running ``server`` (a ``GpuPeerServer``) on ``device`` ("cuda" or
    "cpu")."""
    os.environ[DEVICE_ENV] = device  # inherited by both spawned children
    os.environ.setdefault(ALLOC_ENV, "per_layer")
    return start_pair(p_spec, d_spec, server=server)


class Pair:
    """P and D for one block size, both push workers and both second agents connected.

    By default both sides are kv_split NHD with ``args``' model shape. ``kv_heads`` overrides
    the model's KV heads; ``d`` overrides D's PeerSpec fields (e.g. block_size, token_order,
    num_blocks); ``config`` is added to both workers' PushConfig; ``server`` is the child class.
    """

    def __init__(self, args, bs: int, blocks: int, *, kv_heads: int | None = None,
                 d: dict | None = None, config: dict | None = None, server: str = SERVER):
        common = dict(placement="kv_split", num_layers=args.layers,
                      num_kv_heads=kv_heads or args.kv_heads, head_size=args.head_size,
                      dtype_bytes=2, block_size=bs, num_blocks=blocks, token_order="NHD")
        hb = {"heartbeat_interval_s": args.heartbeat_s, **(config or {})}
        self.P, self.D = start_gpu_pair(
            PeerSpec(role="producer", engine_id="gpubench-prefill",
                     config={"side_channel_port": 0, **hb}, **common),
            PeerSpec(role="decoder", engine_id="gpubench-decode", config=hb,
                     **{**common, **(d or {})}),
            args.device, server)
        self.address = self.P.call("address")
        self.pgeo, self.dgeo = self.P.call("geometry_"), self.D.call("geometry_")
        self.info = self.P.call("info")
        self.pull_ok = True
        try:
            self.P.call("pull_add_peer", self.D.call("pull_agent_metadata"), self.dgeo)
            self.D.call("pull_add_peer", self.P.call("pull_agent_metadata"), self.pgeo)
            self.port = self.D.call("http_port")
        except PeerError as e:
            self.pull_ok = False
            self.pull_error = str(e).strip().splitlines()[-1]
            log(f"  second agents could not connect: {self.pull_error}")
        self.early = 0
        self.seq = 0

    def close(self) -> None:
        self.D.close()
        self.P.close()

    def push(self, pblocks, dblocks, tokens) -> dict:
        self.seq += 1
        key, tid = f"push-{self.seq}", f"xfer-push-{self.seq}"
        self.D.call("expect_at", key, tid, 0, self.address, dblocks, 0, tokens)
        self.early += 1
        wait_counter(self.P, "registrations_early", self.early)
        t0 = self.P.call("prefill_done_at", key, tid, pblocks, tokens)
        got = self.D.call("outcome_at", key, 60.0, timeout=90)
        if got is None or got[0] != "received":
            raise PeerError(f"push {key}: {got}")
        if self.P.call("wait_released", [key], 30.0) != [key]:
            raise PeerError(f"push {key}: P never released its blocks")
        return {"total": got[2] - t0}

    def pull(self, pblocks, dblocks, tokens) -> dict:
        self.seq += 1
        key = f"pull-{self.seq}"
        self.D.call("pull_expect", key, dblocks)
        t0 = self.P.call("pull_prefill_done", key, pblocks, tokens, self.port, 0.0)  # spin, as measured
        res = self.D.call("pull_result", key, 60.0, timeout=90)
        tn = self.P.call("pull_notif_at", key, 60.0)
        if res is None or res.get("state") != "DONE" or tn is None:
            raise PeerError(f"pull {key}: D {res}, P notified at {tn}")
        return {"total": max(res["done"], tn) - t0, "d_has_data": res["done"] - t0,
                "descs": res["descs"],
                "seg": {"relay_http": res["http"] - t0, "desc_build": res["desc"] - res["start"],
                        "post": res["post"] - res["desc"], "read_to_done": res["done"] - res["post"],
                        "done_to_p_notif": tn - res["done"]}}

    def bare_write(self, pblocks, dblocks, tokens) -> dict:
        self.D.call("progress", True)
        try:
            prep = self.P.call("bare_prepare", pblocks, dblocks, tokens, timeout=300)
            r = self.P.call("bare_run", timeout=90)
            self.P.call("bare_release")
        finally:
            self.D.call("progress", False)
        if r["state"] != "DONE":
            raise PeerError(f"bare WRITE: {r}")
        return {"total": r["done"] - r["start"], "descs": prep["descs"],
                "seg": {"post": r["posted"] - r["start"], "post_to_done": r["done"] - r["posted"],
                        "prep_plan": prep["plan_s"], "prep_dlists": prep["dlist_s"],
                        "prep_init_xfer": prep["init_s"]}}


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(samples: list[dict], nbytes: int) -> dict:
    totals = [s["total"] for s in samples]
    m = med(totals)
    out = {"samples_ms": [round(t * 1e3, 3) for t in totals], "median_ms": m * 1e3,
           "min_ms": min(totals) * 1e3, "gbps": nbytes / m / 1e9}
    segs = [s["seg"] for s in samples if "seg" in s]
    if segs:
        out["breakdown_ms"] = {k: med([s[k] for s in segs]) * 1e3 for k in segs[0]}
    if "descs" in samples[0]:
        out["descs"] = samples[0]["descs"]
    if "d_has_data" in samples[0]:
        out["d_has_data_ms"] = med([s["d_has_data"] for s in samples]) * 1e3
    return out


def run_case(pair: Pair, rng, bs: int, tokens: int, blocks: int, args) -> dict:
    nbytes = tokens * per_token_bytes(args)
    n = -(-tokens // bs)
    pblocks = fragmented_blocks(rng, blocks, n)
    dblocks = fragmented_blocks(rng, blocks, n)
    plan = plan_writes(pair.pgeo, pblocks, pair.dgeo, dblocks, first_token=0, num_tokens=tokens)
    seed = int(rng.integers(1 << 20))
    pair.P.call("fill", seed, tokens, pblocks, timeout=600)
    methods = [m for m in METHODS if m == "push" or pair.pull_ok]
    samples: dict[str, list] = {m: [] for m in methods}
    checks: dict[str, dict] = {m: {"transfers": 0, "mismatch": 0, "canary": 0,
                                   "checked_bytes": 0} for m in methods}
    errors: dict[str, str] = {}
    for r in range(args.reps + 1):  # repetition 0 is the warm-up (verified, not counted)
        k = r % len(methods)
        for m in methods[k:] + methods[:k]:
            if m in errors:
                continue
            pair.D.call("canary", timeout=600)
            try:
                s = getattr(pair, m)(pblocks, dblocks, tokens)
            except PeerError as e:
                errors[m] = str(e).strip().splitlines()[-1][:300]
                log(f"    !! {m} failed: {errors[m]}")
                continue
            v = pair.D.call("verify", seed, tokens, dblocks, 0, m == "pull", timeout=600)
            c = checks[m]
            c["transfers"] += 1
            for key in ("mismatch", "canary", "checked_bytes"):
                c[key] += v[key]
            if v["mismatch"] or v["canary"]:
                log(f"    !! {m}: {v['mismatch']} elements wrong, {v['canary']} canary elements "
                    f"overwritten on D")
            if r > 0:
                samples[m].append(s)
    # negative control: the same check against another request's pattern must fail
    neg = pair.D.call("verify", seed + 1, tokens, dblocks, timeout=600)["mismatch"]
    if neg == 0:
        log("    !! negative control: a wrong seed verified clean")
    res = {m: summarize(samples[m], nbytes) for m in methods if samples[m]}
    out = {"block_size": bs, "tokens": tokens, "bytes": nbytes, "blocks": n,
           "pool_blocks": blocks, "reps": args.reps, "checks": checks, "errors": errors,
           "negative_control_mismatch": neg,
           "verified": {m: (checks[m]["transfers"] > 0 and checks[m]["mismatch"] == 0
                            and checks[m]["canary"] == 0 and neg > 0) for m in methods},
           "regions": {"push": plan.num_regions, "unmerged_pieces": plan.unmerged,
                       "pull_descs": 2 * args.layers * n,
                       "merge_ratio": plan.unmerged / max(1, plan.num_regions),
                       "mean_region_kib": nbytes / max(1, plan.num_regions) / 1024},
           **res}
    if "push" in res and "bare_write" in res:
        out["push_over_bare"] = res["push"]["median_ms"] / res["bare_write"]["median_ms"]
        out["push_over_bare_min"] = res["push"]["min_ms"] / res["bare_write"]["min_ms"]
    if "push" in res and "pull" in res:
        out["pull_over_push"] = res["pull"]["median_ms"] / res["push"]["median_ms"]
        out["pull_over_push_min"] = res["pull"]["min_ms"] / res["push"]["min_ms"]
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--block-sizes", default="16,128")
    ap.add_argument("--layers", type=int, default=QWEN3_32B["num_layers"])
    ap.add_argument("--kv-heads", type=int, default=QWEN3_32B["num_kv_heads"])
    ap.add_argument("--head-size", type=int, default=QWEN3_32B["head_size"])
    ap.add_argument("--alloc", default="per_layer", choices=("per_layer", "pool"),
                    help="per_layer: one allocation per layer (as vLLM); pool: one allocation")
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions per method")
    ap.add_argument("--slack", type=float, default=1.125,
                    help="pool size / blocks of the largest case of a block size")
    ap.add_argument("--heartbeat-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--name", default="transfer_gpu", help="output file stem")
    args = ap.parse_args(argv)
    args.token_list = [int(t) for t in args.tokens.split(",")]
    args.bs_list = [int(b) for b in args.block_sizes.split(",")]
    return args


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in ("nixl", "nixl-cu13", "nixl-cu12", "torch", "msgspec", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ[ALLOC_ENV] = args.alloc
    rng = np.random.default_rng(args.seed)
    t_start = time.monotonic()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    cases, failed, infos = [], [], {}
    copy_gbps = None
    total = len(args.bs_list) * len(args.token_list)
    log(f"bench_transfer_gpu: {total} cases on {args.device}, {args.reps} reps of "
        f"{', '.join(METHODS)}; {args.layers} layers x {args.kv_heads} KV heads x "
        f"{args.head_size} bf16 = {per_token_bytes(args) // 1024} KiB/token")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def write() -> dict:
        result = {
            "started": started, "seconds": time.monotonic() - t_start,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "versions": _versions(),
                        "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
                        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
                        "peers": infos,
                        "device_copy_gbps": copy_gbps},
            "args": {k: v for k, v in vars(args).items() if not k.endswith("_list")},
            "model": f"{args.layers} layers, {args.kv_heads} KV heads, head size "
                     f"{args.head_size}, bf16, TP1",
            "cases": cases, "failed": failed,
        }
        (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
        (out / f"{args.name}.md").write_text(markdown(result))
        return result

    done = 0
    for bs in args.bs_list:
        blocks = pool_blocks(max(args.token_list), bs, args.slack)
        gib = 2 * blocks * bs * per_token_bytes(args) / 2**30
        log(f"[bs{bs}] starting P and D, pools of {blocks} blocks ({gib:.1f} GiB together)...")
        t = time.monotonic()
        try:
            pair = Pair(args, bs, blocks)
        except PeerError as e:
            log(f"  could not start: {e}")
            failed.append({"block_size": bs, "error": str(e)})
            continue
        infos[f"bs{bs}"] = pair.info
        log(f"  ready in {time.monotonic() - t:.1f}s: {pair.info}")
        try:
            if copy_gbps is None:
                nb = max(args.token_list) * per_token_bytes(args)
                copy_gbps = pair.P.call("copy_rate", nb, timeout=300)
                log(f"  device copy_ of {nb / 2**30:.2f} GiB: {copy_gbps:.0f} GB/s")
            for tokens in args.token_list:
                done += 1
                t = time.monotonic()
                log(f"  [{done}/{total}] bs{bs} {tokens} tokens "
                    f"({tokens * per_token_bytes(args) / 2**20:.0f} MiB)...")
                try:
                    c = run_case(pair, rng, bs, tokens, blocks, args)
                except PeerError as e:
                    log(f"    FAILED: {str(e).strip().splitlines()[-1]}")
                    failed.append({"block_size": bs, "tokens": tokens, "error": str(e)})
                    continue
                cases.append(c)
                write()  # after every case: a run cut short still leaves its results
                parts = [f"{m} {c[m]['median_ms']:.2f} ms ({c[m]['gbps']:.1f} GB/s)"
                         for m in METHODS if m in c]
                log("    " + " | ".join(parts) + f" | regions {c['regions']['push']} "
                    f"(pieces {c['regions']['unmerged_pieces']}), pull descs "
                    f"{c['regions']['pull_descs']} | verified {c['verified']} "
                    f"({time.monotonic() - t:.0f}s)")
        finally:
            pair.close()
    result = write()
    log(f"\nwrote {out / (args.name + '.json')} and .md ({time.monotonic() - t_start:.0f}s)\n")
    log(markdown(result))
    ok = not failed and bool(cases) and all(all(c["verified"].values()) and not c["errors"]
                                            for c in cases)
    return 0 if ok else 1


def _ms(c: dict, m: str) -> str:
    if m not in c:
        return "failed" if m in c.get("errors", {}) else "-"
    return f"{c[m]['median_ms']:.2f} ({c[m]['gbps']:.1f})"


def markdown(r: dict) -> str:
    m = r["machine"]
    peers = next(iter(m["peers"].values()), {})
    L = ["# Push vs pull on one GPU: VRAM -> VRAM through NIXL UCX (cuda_ipc)\n"]
    L.append(f"Command: `{r['command']}`  ")
    L.append(f"Started {r['started']}, {r['seconds']:.0f} s. {peers.get('gpu', peers.get('device'))}"
             f", torch {peers.get('torch')} (CUDA {peers.get('cuda')}), "
             f"{', '.join(f'{k} {v}' for k, v in m['versions'].items())}; Python {m['python']}, "
             f"{m['cpus']} CPUs; UCX environment {m.get('ucx_env') or '(none set)'}. Two spawned "
             f"processes on the same "
             f"{'GPU' if peers.get('backend') == 'cuda' else 'host (debug run)'}, "
             f"each a real `PushWorker` over per-layer KV tensors "
             f"{peers.get('tensor_shape')} bf16 described by `describe_kv_caches(backend="
             f"{peers.get('backend')})`. Contiguous device `copy_` of the largest case in one "
             f"process: {m['device_copy_gbps'] or float('nan'):.0f} GB/s.  ")
    L.append(f"{r['model']}; P and D kv_split NHD, same block size, block ids fragmented (runs of "
             f"1-3) independently on P and D. One verified warm-up, then {r['args']['reps']} "
             f"interleaved repetitions (order rotating); every transfer, warm-up included, is "
             f"verified on D's GPU (each element of the target tokens against the pattern, every "
             f"other element of D's pool against a canary). Median ms (GB/s).\n")
    L.append("| case | MiB | push | pull | bare WRITE | push/bare | pull/push | push regions "
             "(pieces) | pull descs | KiB/region | verified |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for c in r["cases"]:
        rg = c["regions"]
        ver = "all" if all(c["verified"].values()) and not c["errors"] else \
            ", ".join(f"{k}: {'ok' if v else 'BAD'}" for k, v in c["verified"].items())
        nver = sum(ch["transfers"] for ch in c["checks"].values())
        L.append(f"| bs{c['block_size']} {c['tokens']} tok | {c['bytes'] / 2**20:.0f} | "
                 f"{_ms(c, 'push')} | {_ms(c, 'pull')} | {_ms(c, 'bare_write')} | "
                 f"{c.get('push_over_bare', float('nan')):.2f} | "
                 f"{c.get('pull_over_push', float('nan')):.2f} | {rg['push']} "
                 f"({rg['unmerged_pieces']}) | {rg['pull_descs']} | {rg['mean_region_kib']:.0f} | "
                 f"{ver} ({nver} transfers) |")
    for f in r["failed"]:
        L.append(f"| bs{f['block_size']} {f.get('tokens', 'all')} tok | FAILED: "
                 f"{f['error'].strip().splitlines()[-1][:150]} ||||||||| ")
    L.append("")
    if any("breakdown_ms" in c.get("pull", {}) for c in r["cases"]):
        L.append("Pull breakdown (medians, ms): relay = P's prefill-done to D's HTTP handler; "
                 "descs = per-block descriptor arrays; post = get_xfer_descs + initialize_xfer + "
                 "transfer(); read = to DONE on D; notif = D's DONE to P's notification.\n")
        L.append("| case | relay | descs | post | read | notif | D has data | total |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for c in r["cases"]:
            if "pull" not in c:
                continue
            b = c["pull"]["breakdown_ms"]
            L.append(f"| bs{c['block_size']} {c['tokens']} | {b['relay_http']:.2f} | "
                     f"{b['desc_build']:.2f} | {b['post']:.2f} | {b['read_to_done']:.2f} | "
                     f"{b['done_to_p_notif']:.2f} | {c['pull']['d_has_data_ms']:.2f} | "
                     f"{c['pull']['median_ms']:.2f} |")
        L.append("")
    if any("bare_write" in c for c in r["cases"]):
        L.append("Bare WRITE (medians, ms): post = transfer(); wait = post to DONE; outside the "
                 "timed span: plan = plan_writes, dlists = get_xfer_descs x2, init = "
                 "initialize_xfer.\n")
        L.append("| case | descs | post | wait | plan | dlists | init |")
        L.append("|---|---:|---:|---:|---:|---:|---:|")
        for c in r["cases"]:
            if "bare_write" not in c:
                continue
            b = c["bare_write"]["breakdown_ms"]
            L.append(f"| bs{c['block_size']} {c['tokens']} | {c['bare_write']['descs']} | "
                     f"{b['post']:.2f} | {b['post_to_done']:.2f} | {b['prep_plan']:.2f} | "
                     f"{b['prep_dlists']:.2f} | {b['prep_init_xfer']:.2f} |")
        L.append("")
    L.append("Samples (ms, measured repetitions in run order):\n")
    for c in r["cases"]:
        L.append(f"- bs{c['block_size']} {c['tokens']}: " + "; ".join(
            f"{m} {c[m]['samples_ms']}" for m in METHODS if m in c))
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
