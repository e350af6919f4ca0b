"""Synthetic KV pools in host memory, for the demo, the benchmarks and the tests.

A ``HostPool`` is a numpy buffer with a ``KVGeometry`` laid over it. ``scatter`` writes a logical
KV tensor ``L[layer, k/v, token, global_head, byte]`` into blocks the way the geometry says;
``gather`` reads it back. They index memory block by block with plain reshapes, independently
of ``layout.plan_writes``, so they can check it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .geometry import KVGeometry, TokenOrder, pool_bytes, pooled


class HostPool:
    def __init__(self, *, placement: str, num_layers: int, num_kv_heads: int, head_size: int,
                 dtype_bytes: int, block_size: int, num_blocks: int, tp_size: int = 1,
                 tp_rank: int = 0, token_order: TokenOrder = "NHD", dtype: str = "bfloat16",
                 fill: int | None = 0):
        local = max(1, num_kv_heads // tp_size)
        block_bytes = block_size * local * head_size * dtype_bytes
        nbytes = pool_bytes(placement=placement, num_layers=num_layers, num_blocks=num_blocks,
                            block_bytes=block_bytes)
        self.buf = np.empty(nbytes, dtype=np.uint8)
        if fill is not None:
            self.buf.fill(fill)
        self.base = int(self.buf.ctypes.data)
        self.geometry = pooled(
            base=self.base, placement=placement, num_layers=num_layers,
            num_kv_heads=num_kv_heads, head_size=head_size, dtype_bytes=dtype_bytes, dtype=dtype,
            block_size=block_size, num_blocks=num_blocks, tp_size=tp_size, tp_rank=tp_rank,
            token_order=token_order)

    def _block(self, layer: int, kv: int, block: int) -> np.ndarray:
        g = self.geometry
        base = g.part_bases[kv][layer] + block * g.block_stride
        raw = self.buf[base - self.base: base - self.base + g.block_bytes]
        if g.token_order == "NHD":
            return raw.reshape(g.block_size, g.local_heads, g.vec_bytes)
        return raw.reshape(g.local_heads, g.block_size, g.vec_bytes).transpose(1, 0, 2)

    def scatter(self, logical: np.ndarray, block_ids: Sequence[int], first_token: int = 0) -> None:
        """Write tokens ``first_token...`` of ``logical`` (all heads) into ``block_ids``."""
        g = self.geometry
        lo, hi = g.head_range
        ntok = logical.shape[2]
        for j, b in enumerate(block_ids):
            t0 = first_token + j * g.block_size
            t1 = min(t0 + g.block_size, ntok)
            if t0 >= ntok:
                break
            for layer in range(g.num_layers):
                for kv in range(g.kv_parts):
                    self._block(layer, kv, b)[: t1 - t0] = logical[layer, kv, t0:t1, lo:hi]

    def gather(self, block_ids: Sequence[int], first_token: int, num_tokens: int) -> np.ndarray:
        """Tokens [first_token, num_tokens) of this rank's heads: (layers, 2, n, heads, bytes)."""
        g = self.geometry
        out = np.empty((g.num_layers, g.kv_parts, num_tokens - first_token, g.local_heads,
                        g.vec_bytes),
                       dtype=np.uint8)
        for j, b in enumerate(block_ids):
            t0 = j * g.block_size
            t1 = min(t0 + g.block_size, num_tokens - first_token)
            if t0 >= t1:
                break
            for layer in range(g.num_layers):
                for kv in range(g.kv_parts):
                    out[layer, kv, t0:t1] = self._block(layer, kv, b)[: t1 - t0]
        return out


def logical_kv(seed: int, *, num_layers: int, num_tokens: int, num_kv_heads: int,
               vec_bytes: int, kv_parts: int = 2) -> np.ndarray:
    """A reproducible random logical KV tensor ``[layer, part, token, head, byte]``."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (num_layers, kv_parts, num_tokens, num_kv_heads, vec_bytes),
                        dtype=np.uint8)


def fragmented_blocks(rng: np.random.Generator, num_blocks: int, count: int) -> list[int]:
    """Block ids as a busy server hands them out: mostly short runs, scattered over the pool."""
    if count > num_blocks:
        raise ValueError(f"need {count} blocks, pool has {num_blocks}")
    free = rng.permutation(num_blocks)
    out: list[int] = []
    taken: set[int] = set()
    i = 0
    while len(out) < count:
        start = int(free[i % num_blocks])
        i += 1
        run = int(rng.integers(1, 4))
        for b in range(start, min(start + run, num_blocks)):
            if b not in taken and len(out) < count:
                taken.add(b)
                out.append(b)
    return out
