"""KV-cache geometry: where every (layer, K/V, block, token, head) of one worker's cache lives.

This is the one description both sides exchange. It is pure data (a msgspec struct, so it travels
on the wire unchanged) and knows nothing of torch or NIXL.

Memory model, per worker (one TP rank):

* The worker holds ``local_heads`` of the model's ``num_kv_heads`` KV heads (see ``head_range``).
* For layer ``l``, the K part of block ``b`` starts at ``k_bases[l] + b * block_stride`` and the
  V part at ``v_bases[l] + b * block_stride``. One block part is ``block_bytes`` long
  (``block_size * local_heads * head_size * dtype_bytes``).
* Inside a block part, one (token, head) vector of ``head_size`` elements is contiguous. Its index
  is ``token * local_heads + head`` for token-major ``NHD`` and ``head * block_size + token`` for
  head-major ``HND``. ``opaque`` says the interior has no such order (vLLM's CPU backend tiles
  blocks per ISA): such blocks are copied whole, only between identical geometries.

The usual vLLM placements are constructors:

* ``kv_split`` -- K and V are two separate regions per layer (a ``(2, num_blocks, ...)`` tensor,
  or two tensors as on Neuron): ``block_stride == block_bytes``.
* ``blocks_first`` -- one region per layer in which every block holds its K then its V
  (``(num_blocks, 2, ...)``): ``block_stride == 2 * block_bytes``, ``v_base = k_base + block_bytes``.
* ``kv_parts == 1`` -- one part per block whose vectors hold K and V together (vLLM's CPU backend:
  ``(num_blocks, heads, block_size, 2 * head_size)``, each vector ``[K | V]``), or a single latent
  (MLA). ``head_size`` then counts the elements of that combined vector and ``v_bases`` is empty.

Addresses are absolute in the owning process (they are what NIXL descriptors carry); ``dev_id``
is the device the memory is on (0 for host DRAM).
"""

from __future__ import annotations

from typing import Literal

import msgspec

TokenOrder = Literal["NHD", "HND", "opaque"]


class GeometryError(ValueError):
    """A geometry that cannot describe real memory, or two geometries that cannot be mapped."""


class KVGeometry(msgspec.Struct, frozen=True, kw_only=True):
    num_layers: int
    num_kv_heads: int  # the model's KV heads, all ranks together
    head_size: int
    dtype_bytes: int
    dtype: str  # e.g. "bfloat16"; sides must agree
    block_size: int  # tokens per block
    token_order: TokenOrder
    tp_size: int
    tp_rank: int
    num_blocks: int
    block_stride: int  # bytes from block b to block b+1 in every layer's K (and V) region
    k_bases: tuple[int, ...]  # per layer, address of block 0's K part
    v_bases: tuple[int, ...]  # per layer, address of block 0's V part
    mem_type: str = "DRAM"  # NIXL memory type of these addresses: "DRAM" or "VRAM"
    dev_id: int = 0
    kv_parts: int = 2  # 2: K and V parts per block; 1: one combined part (see module doc)

    # -- derived -----------------------------------------------------------------------------
    @property
    def local_heads(self) -> int:
        """KV heads this rank holds (see the module function ``local_heads``)."""
        return local_heads(self.num_kv_heads, self.tp_size)

    @property
    def head_range(self) -> tuple[int, int]:
        """Global KV heads [lo, hi) this rank holds (replicated when tp_size > num_kv_heads)."""
        return head_range(self.num_kv_heads, self.tp_size, self.tp_rank)

    @property
    def vec_bytes(self) -> int:
        """Bytes of one (token, head) vector."""
        return self.head_size * self.dtype_bytes

    @property
    def part_bases(self) -> tuple[tuple[int, ...], ...]:
        """Per part (K, then V when kv_parts == 2), the per-layer base addresses."""
        return (self.k_bases, self.v_bases) if self.kv_parts == 2 else (self.k_bases,)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K (or V) part on this rank."""
        return self.block_size * self.local_heads * self.vec_bytes

    def validate(self) -> None:
        """Raise GeometryError if the description cannot be real."""
        ints = {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype_bytes": self.dtype_bytes,
            "block_size": self.block_size,
            "tp_size": self.tp_size,
            "num_blocks": self.num_blocks,
        }
        for name, value in ints.items():
            if value <= 0:
                raise GeometryError(f"{name} must be positive, got {value}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise GeometryError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if self.token_order not in ("NHD", "HND", "opaque"):
            raise GeometryError(
                f"token_order must be NHD, HND or opaque, got {self.token_order!r}")
        check_head_split(self.num_kv_heads, self.tp_size)
        if self.kv_parts not in (1, 2):
            raise GeometryError(f"kv_parts must be 1 or 2, got {self.kv_parts}")
        want_v = self.num_layers if self.kv_parts == 2 else 0
        if len(self.k_bases) != self.num_layers or len(self.v_bases) != want_v:
            raise GeometryError(
                f"expected {self.num_layers} K and {want_v} V bases, got {len(self.k_bases)} "
                f"and {len(self.v_bases)}"
            )
        if self.block_stride < self.block_bytes:
            raise GeometryError(
                f"block_stride {self.block_stride} is smaller than one block part "
                f"({self.block_bytes} bytes)"
            )
        if self.mem_type not in ("DRAM", "VRAM"):
            raise GeometryError(f"mem_type must be DRAM or VRAM, got {self.mem_type!r}")

    def compatible_with(self, other: "KVGeometry",
                        sides: tuple[str, str] = ("here", "at the peer")) -> None:
        """Raise GeometryError unless KV of ``self`` can be written into ``other``.
        ``sides`` names ``self`` and ``other`` in the message."""
        here, there = sides
        for name in ("num_layers", "num_kv_heads", "head_size", "dtype_bytes", "dtype", "kv_parts"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                raise GeometryError(f"{name} differs: {a} {here}, {b} {there}")
        if "opaque" in (self.token_order, other.token_order):
            # an opaque block interior can only be copied whole into an identical block
            for name in ("token_order", "block_size", "tp_size", "block_bytes"):
                a, b = getattr(self, name), getattr(other, name)
                if a != b:
                    raise GeometryError(
                        f"opaque block layouts need equal {name}: {a} {here}, {b} {there}")

    def regions(self) -> list[tuple[int, int]]:
        """(address, length) of the memory to register: one span per layer and part.

        Spans that overlap (blocks_first: K and V interleaved in one tensor) are one region;
        spans that merely touch are NOT merged: two tensors that happen to be adjacent are two
        device allocations, and a region crossing allocations cannot be mapped (UCX cuda_ipc
        maps the allocation of a region's first byte).
        """
        spans = []
        reach = (self.num_blocks - 1) * self.block_stride + self.block_bytes
        interleaved = self.kv_parts == 2 and self.block_stride == 2 * self.block_bytes
        for l, k in enumerate(self.k_bases):
            v = self.v_bases[l] if self.kv_parts == 2 else None
            if interleaved and v == k + self.block_bytes:
                spans.append((k, v + reach))  # blocks_first: one tensor holds the layer's K and V
                continue
            spans.append((k, k + reach))
            if v is not None:
                spans.append((v, v + reach))
        spans.sort()
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return [(lo, hi - lo) for lo, hi in merged]


def local_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank of a TP group holds: ``num_kv_heads / tp_size``, or 1 when the group has
    more ranks than heads (each head is then replicated on ``tp_size / num_kv_heads`` ranks)."""
    return max(1, num_kv_heads // tp_size)


def check_head_split(num_kv_heads: int, tp_size: int, side: str = "") -> None:
    """Raise GeometryError unless ``num_kv_heads`` KV heads can be spread over ``tp_size`` ranks:
    an even split (``tp_size <= num_kv_heads``) or an equal number of replicas per head.
    ``side`` ("producer", "decoder") names the TP group in the message."""
    tp = f"{side} TP" if side else "TP"
    if num_kv_heads <= 0:
        raise GeometryError(f"num_kv_heads must be positive, got {num_kv_heads}")
    if tp_size <= 0:
        raise GeometryError(f"{tp} size must be positive, got {tp_size}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise GeometryError(f"{num_kv_heads} KV heads do not split evenly over {tp} {tp_size}")
    elif tp_size % num_kv_heads:
        raise GeometryError(f"{tp} {tp_size} is not a multiple of {num_kv_heads} KV heads")


def head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Global KV heads ``[lo, hi)`` that rank ``tp_rank`` of a TP group of ``tp_size`` holds."""
    if tp_size <= num_kv_heads:
        per = local_heads(num_kv_heads, tp_size)
        return tp_rank * per, (tp_rank + 1) * per
    replicas = tp_size // num_kv_heads
    h = tp_rank // replicas
    return h, h + 1


def _block_bytes(kw: dict) -> int:
    """Fill the constructors' defaults into ``kw``; return one block part's bytes."""
    kw.setdefault("tp_size", 1)
    kw.setdefault("tp_rank", 0)
    kw.setdefault("token_order", "NHD")
    local = local_heads(kw["num_kv_heads"], kw["tp_size"])
    return kw["block_size"] * local * kw["head_size"] * kw["dtype_bytes"]


def kv_split(*, layer_bases, **kw) -> KVGeometry:
    """K and V as separate regions per layer: ``layer_bases[l] == (k_base, v_base)``.

    ``kw``: the remaining ``KVGeometry`` fields (num_kv_heads, head_size, dtype_bytes, dtype,
    block_size, num_blocks, and optionally tp_size, tp_rank, token_order, mem_type, dev_id).
    """
    block_bytes = _block_bytes(kw)
    return KVGeometry(num_layers=len(layer_bases), block_stride=block_bytes,
                      k_bases=tuple(int(k) for k, _ in layer_bases),
                      v_bases=tuple(int(v) for _, v in layer_bases), **kw)


def blocks_first(*, layer_bases, **kw) -> KVGeometry:
    """One region per layer, each block holding its K then its V (``kw`` as for kv_split)."""
    block_bytes = _block_bytes(kw)
    return KVGeometry(num_layers=len(layer_bases), block_stride=2 * block_bytes,
                      k_bases=tuple(int(b) for b in layer_bases),
                      v_bases=tuple(int(b) + block_bytes for b in layer_bases), **kw)


def pool_bytes(
    *, placement: str, num_layers: int, num_blocks: int, block_bytes: int
) -> int:
    """Bytes a contiguous pool needs for ``placement`` ("kv_split" or "blocks_first")."""
    if placement not in ("kv_split", "blocks_first", "combined"):
        raise GeometryError(f"unknown placement {placement!r}")
    parts = 1 if placement == "combined" else 2
    return num_layers * parts * num_blocks * block_bytes


def pooled(*, base: int, placement: str, num_layers: int, **kw) -> KVGeometry:
    """A geometry for one contiguous pool at ``base`` laid out layer after layer.

    Used by the host backend, the demo, the tests and the benchmarks, where we own the memory.
    ``placement`` is "kv_split", "blocks_first" or "combined" (``kv_parts == 1``, vLLM CPU's
    ``[K | V]`` vectors: one part per block, ``head_size`` elements per vector); ``kw`` as for
    ``kv_split``.
    """
    block_bytes = _block_bytes(kw)
    num_blocks = kw["num_blocks"]
    part = num_blocks * block_bytes
    if placement == "kv_split":
        return kv_split(layer_bases=[(base + 2 * l * part, base + (2 * l + 1) * part)
                                     for l in range(num_layers)], **kw)
    if placement == "blocks_first":
        return blocks_first(layer_bases=[base + 2 * l * part for l in range(num_layers)], **kw)
    if placement == "combined":
        return KVGeometry(num_layers=num_layers, block_stride=block_bytes, kv_parts=1,
                          k_bases=tuple(base + l * part for l in range(num_layers)), v_bases=(),
                          **kw)
    raise GeometryError(f"unknown placement {placement!r}")
