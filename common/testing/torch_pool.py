"""KV memory as torch tensors on a device, shaped as vLLM allocates them, with an exact pattern.

``TorchMemory`` is a peer server's memory (see ``peer_server``) for ``PeerSpec.memory`` =
``"torch:cuda"`` (``CudaBackend``, VRAM) or ``"torch:cpu"`` (``HostBackend``, to debug without a
GPU): per layer one bf16 tensor in vLLM FlashAttention's shape, ``(2, num_blocks, block_size,
heads, head_size)`` for ``kv_split`` or ``(num_blocks, 2, ...)`` for ``blocks_first``; token order
HND allocates head-major and hands over the permuted view, as an HND attention backend does.
``PeerSpec.alloc``: ``per_layer`` (one allocation per layer, as vLLM) or ``pool`` (one allocation,
layer views). The geometry comes from ``describe_kv_caches``, the production path.

The pattern (``TensorPattern``) is a deterministic function of (seed, layer, K/V, token, global
head, element), computed on the device as int16 bit patterns; fills and checks run on the device
and only counts come back. torch is imported only when a ``TorchMemory`` is built.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .peer_process import PeerSpec

CANARY_D = 0x5A5A  # int16 bit pattern the decoder's pool holds before every transfer
CANARY_P = 0x3C3C  # the producer's blocks outside the prompt
_M32 = 0xFFFFFFFF


def as_i16(value: int) -> int:
    """A 16-bit pattern as the signed value torch.int16 stores."""
    return value - 0x10000 if value >= 0x8000 else value


def _lk_key(seed: int, layer: int, kv: int) -> int:
    """A 32-bit key per (request seed, layer, K/V), mixed on the host."""
    x = (seed * 0x9E3779B1 + layer * 0x85EBCA77 + kv * 0xC2B2AE3D + 0x27D4EB2F) & _M32
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & _M32
    x ^= x >> 12
    return x


class TensorPattern:
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


class TorchMemory:
    """Per-layer torch KV tensors on ``device`` ("cuda" or "cpu"), described for a PushWorker.

    The public methods are commands a ``LocalPeer`` can call (``fill``/``canary``/``verify``,
    ``info``, ``copy_rate``)."""

    def __init__(self, spec: PeerSpec, device: str):
        import torch

        from ..backend import HostBackend
        from ..geometry import local_heads
        from ..kv_tensors import describe_kv_caches

        self.torch = torch
        if device == "cuda":
            from kv_push.gpu_push.backend import CudaBackend
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
            self.backend: Any = CudaBackend()
        elif device == "cpu":
            self.device = torch.device("cpu")
            self.backend = HostBackend()
        else:
            raise ValueError(f"torch memory on {device!r}: use cuda or cpu")
        local_heads = local_heads(spec.num_kv_heads, spec.tp_size)
        nb, bs, d = spec.num_blocks, spec.block_size, spec.head_size
        if spec.dtype_bytes != 2:
            raise ValueError("torch memory is bf16 KV (dtype_bytes 2)")
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
            raise ValueError(f"placement {spec.placement!r} not supported by torch memory")
        self.alloc = spec.alloc
        if self.alloc == "pool":
            pool = torch.empty((spec.num_layers, *phys), dtype=torch.bfloat16, device=self.device)
            raw = [pool[i] for i in range(spec.num_layers)]
        elif self.alloc == "per_layer":
            raw = [torch.empty(phys, dtype=torch.bfloat16, device=self.device)
                   for _ in range(spec.num_layers)]
        else:
            raise ValueError(f"PeerSpec.alloc {self.alloc!r}: use per_layer or pool")
        # an HND backend's cache is head-major; the connector gets the logical permuted view
        self.layers = [t.transpose(-3, -2) if spec.token_order == "HND" else t for t in raw]
        self._dims = dims
        self.geometry = describe_kv_caches(
            self.layers, backend=self.backend, num_kv_heads=spec.num_kv_heads, head_size=d,
            block_size=bs, tp_size=spec.tp_size, tp_rank=spec.tp_rank, dtype="bfloat16",
            dims=dims)
        g = self.geometry
        self.pattern = TensorPattern(torch, self.device, g.head_range[0], g.local_heads, d)

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
        out = {"backend": self.backend.name, "device": str(self.device),
               "torch": torch.__version__, "alloc": self.alloc,
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
            t.view(self.torch.int16).fill_(as_i16(CANARY_P))
        for layer in range(g.num_layers):
            for kv in range(g.kv_parts):
                vals = self.pattern.values(seed, layer, kv, first_token, first_token + nb * bs)
                self._part(layer, kv)[ids] = vals.view(nb, bs, g.local_heads, g.head_size)
        self._sync()

    def hide_layers(self, block_ids) -> None:
        """Layer-wise tests: set the request's blocks aside (every layer) and zero them."""
        g = self.geometry
        self._hidden_ids = ids = self._ids(block_ids)
        self._hidden = [[self._part(layer, kv)[ids].clone() for kv in range(g.kv_parts)]
                        for layer in range(g.num_layers)]
        for layer in range(g.num_layers):
            for kv in range(g.kv_parts):
                self._part(layer, kv)[ids] = 0
        self._sync()

    def restore_layer(self, layer: int, delay_cycles: int = 0) -> None:
        """Write ``layer``'s blocks back on the current stream -- after a ``delay_cycles``
        device spin (CUDA), so that only work ordered after this (an event recorded next)
        sees them -- as a forward writes a layer's KV."""
        if delay_cycles and self.device.type == "cuda":
            self.torch.cuda._sleep(int(delay_cycles))
        for kv, data in enumerate(self._hidden[layer]):
            self._part(layer, kv)[self._hidden_ids] = data

    def canary(self) -> None:
        """D: every byte of the pool to CANARY_D."""
        for t in self.layers:
            t.view(self.torch.int16).fill_(as_i16(CANARY_D))
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
        c = as_i16(CANARY_D)
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

    def close(self) -> None:
        pass
