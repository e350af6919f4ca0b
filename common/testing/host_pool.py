"""Synthetic KV pools in host memory, for the demo, the benchmarks and the tests.

A ``HostPool`` is a numpy buffer with a ``KVGeometry`` laid over it. ``scatter`` writes a logical
KV tensor ``L[layer, k/v, token, global_head, byte]`` into blocks the way the geometry says;
``gather`` reads it back. They index memory block by block with plain reshapes (``block_view``),
independently of ``layout.plan_writes``, so they can check it.

``HostMemory`` is a peer server's memory over a ``HostPool`` (see ``peer_server``): the pool,
its geometry, and the fill/verify commands the tests and the demo send to a peer process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..geometry import TokenOrder, local_heads, pool_bytes, pooled
from . import pattern

if TYPE_CHECKING:
    from .peer_process import PeerSpec


class HostPool:
    def __init__(self, *, placement: str, num_layers: int, num_kv_heads: int, head_size: int,
                 dtype_bytes: int, block_size: int, num_blocks: int, tp_size: int = 1,
                 tp_rank: int = 0, token_order: TokenOrder = "NHD", dtype: str = "bfloat16",
                 fill: int | None = 0):
        local = local_heads(num_kv_heads, tp_size)
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

    def block_view(self, layer: int, kv: int, block: int) -> np.ndarray:
        """A writable view (block_size, local_heads, vec_bytes) of one block part, token-major
        whatever the geometry's token order."""
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
                    self.block_view(layer, kv, b)[: t1 - t0] = logical[layer, kv, t0:t1, lo:hi]

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
                    out[layer, kv, t0:t1] = self.block_view(layer, kv, b)[: t1 - t0]
        return out


def logical_kv(seed: int, *, num_layers: int, num_tokens: int, num_kv_heads: int,
               vec_bytes: int, kv_parts: int = 2) -> np.ndarray:
    """A reproducible random logical KV tensor ``[layer, part, token, head, byte]``."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (num_layers, kv_parts, num_tokens, num_kv_heads, vec_bytes),
                        dtype=np.uint8)


class HostMemory:
    """A peer server's KV memory in host DRAM: a ``HostPool`` built from a ``PeerSpec``.

    ``backend`` is None: the ``PushWorker`` uses its default (``HostBackend``). The public
    methods are commands a ``LocalPeer`` can call (see ``peer_server.PeerServer.command``).
    """

    backend = None

    def __init__(self, spec: PeerSpec):
        self.pool = HostPool(placement=spec.placement, num_layers=spec.num_layers,
                             num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                             dtype_bytes=spec.dtype_bytes, block_size=spec.block_size,
                             num_blocks=spec.num_blocks, tp_size=spec.tp_size,
                             tp_rank=spec.tp_rank, token_order=spec.token_order)  # type: ignore[arg-type]
        self.geometry = self.pool.geometry

    def _logical(self, seed: int, num_tokens: int) -> np.ndarray:
        g = self.geometry
        return logical_kv(seed, num_layers=g.num_layers, num_tokens=num_tokens,
                          num_kv_heads=g.num_kv_heads, vec_bytes=g.vec_bytes, kv_parts=g.kv_parts)

    # -- exact random KV (a fresh tensor per request: exact, slow for GiBs) ---------------------
    def fill(self, seed: int, num_tokens: int, block_ids, first_token: int = 0) -> None:
        """Write tokens ``[first_token, num_tokens)`` of request ``seed``'s logical KV."""
        self.pool.scatter(self._logical(seed, num_tokens), block_ids, first_token)

    def verify(self, seed: int, num_tokens: int, block_ids, first_token: int) -> int:
        """Number of bytes in ``block_ids`` that differ from the logical KV (0 = correct)."""
        lo, hi = self.geometry.head_range
        want = self._logical(seed, num_tokens)[:, :, first_token:num_tokens, lo:hi]
        got = self.pool.gather(block_ids, first_token, num_tokens)
        return int(np.count_nonzero(got != want))

    # -- the pattern table (memcpy speed; see ``pattern``) --------------------------------------
    def fill_pattern(self, seed: int, num_tokens: int, block_ids, first_token: int = 0) -> None:
        pattern.fill_pattern(self.pool, seed, block_ids, num_tokens, first_token)

    def verify_pattern(self, seed: int, num_tokens: int, block_ids, first_token: int = 0) -> int:
        return pattern.verify_pattern(self.pool, seed, block_ids, num_tokens, first_token)

    # -- raw bytes ------------------------------------------------------------------------------
    def hide_layers(self, block_ids) -> None:
        """Layer-wise tests: set the bytes of ``block_ids`` aside (every layer) and zero them."""
        g = self.geometry
        self._hidden = {(layer, part, b): self.pool.block_view(layer, part, b).copy()
                        for layer in range(g.num_layers) for part in range(g.kv_parts)
                        for b in block_ids}
        for view in (self.pool.block_view(*k) for k in self._hidden):
            view[...] = 0

    def restore_layer(self, layer: int, delay_cycles: int = 0) -> None:
        """Write ``layer``'s bytes set aside by ``hide_layers`` back (as a forward would)."""
        for (lay, part, b), data in self._hidden.items():
            if lay == layer:
                self.pool.block_view(lay, part, b)[...] = data

    def fill_byte(self, value: int) -> None:
        """Every byte of the pool to ``value``."""
        self.pool.buf.fill(value)

    def _parts(self, block_ids):
        """Every (layer, K/V) part of these blocks as a flat byte view."""
        g = self.geometry
        for b in block_ids:
            for bases in g.part_bases:
                for base in bases:
                    off = base - self.pool.base + b * g.block_stride
                    yield self.pool.buf[off: off + g.block_bytes]

    def block_bytes_equal(self, block_ids, value: int) -> bool:
        """True if every byte of these blocks (all layers, K and V) equals ``value``."""
        return not any(np.any(part != value) for part in self._parts(block_ids))

    def fill_blocks(self, block_ids, value: int) -> None:
        """Set every byte of these blocks (all layers, K and V) to ``value`` (a canary)."""
        for part in self._parts(block_ids):
            part[...] = value

    def zero_blocks(self, block_ids) -> None:
        """Every byte of these blocks to 0."""
        self.fill_blocks(block_ids, 0)

    def close(self) -> None:
        pass
