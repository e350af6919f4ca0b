"""Staged transfers: the canonical slot layout and the gather/scatter index plans.

Pure numpy: no torch, no NIXL. The staged path moves one request's KV in three steps: the
producer (P) *packs* its blocks into a contiguous staging buffer in a canonical order, WRITEs that
buffer in a few large chunks into a *slot* of the decoder's (D) staging pool, and D *unpacks* each
chunk into its own blocks. The canonical order is what both sides agree on, so block sizes, NHD vs
HND, kv_split vs blocks_first and TP slicing in either direction are only index math on each side
(``staging_ops`` runs it with torch; ``layout.py`` is the region path this replaces).

Slot (what one D rank receives for one request)
-----------------------------------------------
For D rank ``d`` and tokens ``[first_token, num_tokens)`` (``T`` of them), the slot holds one
*sub-slice* per writer P rank, in :func:`~kv_push.common.layout.writer_ranks` order (increasing
rank), each starting at a multiple of :data:`WRITER_ALIGN` bytes. Writer ``w`` writes the global
heads ``[lo, hi)`` (``nh`` of them) and its sub-slice is laid out as::

    [layer][K/V part][token][head][head_size elements]      (kv_parts == 1: a single part)

so one *(layer, part) run* is ``part_bytes = T * nh * vec_bytes`` and one layer is ``kv_parts``
runs. Opaque geometries (vLLM's CPU tiles, equal geometry on both sides) move whole blocks: a run
is then the ``ceil(T / block_size)`` blocks' parts back to back. A *chunk* is a group of
consecutive layers of one writer's sub-slice, hence contiguous; each chunk is one WRITE and one
notice. :func:`slot_layout` computes all of it; both sides call it with the same arguments (D's
geometry, P's TP size, the token range) and get the same numbers.

Plans (one side's index math)
-----------------------------
A :class:`StagingPlan` moves one writer's sub-slice between the canonical order and one side's
cache: :func:`gather_plan` for P (pack), :func:`scatter_plan` for D (unpack), or the checked
pairings :func:`pack_plan` / :func:`unpack_plans`. A plan is a few :class:`Segment` s; each names a
*unit* (the row of a strided view of one (layer, part) of the cache, :class:`ViewSpec`), the row
ids in canonical order, and where the segment's bytes start inside a (layer, part) run. Row ids
are the same for every layer and part: layers and parts differ only by their base address.

Units, coarsest first, chosen per plan from what is contiguous on *that* side:

* ``block``  -- a whole block part, when its ``block_size`` tokens x local heads are exactly a
                canonical run (all local heads written, and NHD, or one head, or one token per
                block). Blocks only partly inside the token range (the prefix or the tail) go as
                ``token`` rows in their own segments.
* ``token``  -- one token's written heads (NHD, or a single head in HND).
* ``vector`` -- one (token, head) vector (e.g. several heads of an HND block).

Opaque plans are whole blocks (``block``), needing equal geometry (as in ``layout.py``).
``StagingPlan.word_bytes`` is the widest integer word (1, 2, 4 or 8 bytes) that divides every
offset, stride and row of the plan and the cache's base addresses: ops view memory in such words.

Validation
----------
As in ``layout.py`` (whose helpers this module uses): bad input raises :class:`GeometryError` --
invalid or incompatible geometries, block ids outside ``[0, num_blocks)``, too few blocks for the
token range, a D block listed twice among the blocks written, ``first_token`` not a multiple of
D's block size, ``first_token > num_tokens``, negative counts, heads the rank does not hold.

Configuration (``config.PushConfig``; ``staged.py`` uses this module in the roles)
-----------------------------------------------------------------------------------
* ``staged``: ``"auto"`` (default) | ``"off"``. Auto: use the staged path when both peers announce
  it and both pools have room; otherwise the region path, counted in the metrics
  (``staged_fallback{reason}``: ``no_slot``, ``peer``, ``producer_pool``, ``bad_slot``, ``error``).
  Opaque blocks are staged too, packed whole (equal geometry on both sides, as on the region path).
* ``decoder_staging_bytes``: D's registered staging pool per worker. Default (``-1``) ``2 << 30``
  on CUDA, ``0`` (off) on the host backend (its opaque blocks are already large regions). A request
  whose slot does not fit falls back to regions. Must hold the largest request to stage:
  ``tokens * layers * 2 * local_heads * head_size * dtype_bytes`` (Qwen3-32B, TP1: 256 KiB/token,
  so 16k tokens = 4 GiB).
* ``producer_staging_bytes``: P's pool, same default. P packs a whole request into it (layer-wise
  streaming packs before D's registration is known), so it bounds the prefills in flight.
* ``staging_chunk_bytes``: target bytes per chunk (WRITE + notice), default ``512 << 20``: on one
  H200, 8 chunks of 8 layers moved 4 GiB as fast as one WRITE and 64 one-layer chunks 1.5x slower
  (``../shared/notes/gpu-staging.md``). Chunk boundaries must be the same on both sides: D picks
  ``layers_per_chunk`` with :func:`layers_per_chunk` and sends it in its registration.
* slots are aligned to 4096 bytes in the pools (``staged.SLOT_ALIGN``, not a key).

Both pools are allocated in ``register_kv_caches``, i.e. *after* vLLM sized its KV cache, so they
never take blocks from vLLM's KV cache; they come out of the ``1 - gpu_memory_utilization``
share vLLM leaves for everything else (activations, CUDA graphs, NCCL). Lower
``--gpu-memory-utilization`` by ``pool_bytes / total_gpu_memory`` (2 GiB on a 141 GB H200: 0.015)
when that share is tight; the worker logs each pool's size at start (``worker.PushWorker``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from .geometry import GeometryError, KVGeometry, check_head_split
from .layout import _as_count, _block_ids, _check_addresses, _order, writer_ranks

__all__ = [
    "WRITER_ALIGN", "UNITS", "WriterSlice", "Chunk", "SlotLayout", "slot_layout", "slot_bytes",
    "layers_per_chunk", "ViewSpec", "Segment", "StagingPlan", "gather_plan", "scatter_plan",
    "pack_plan", "unpack_plans",
]

#: every writer's sub-slice starts at a multiple of this many bytes from the slot's start
WRITER_ALIGN = 256
#: plan units, coarsest first
UNITS = ("block", "token", "vector")


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


# -- the slot ----------------------------------------------------------------------------------


class WriterSlice(NamedTuple):
    """One writer P rank's part of a slot."""

    rank: int  # P rank
    heads: tuple[int, int]  # global KV heads [lo, hi) it writes
    offset: int  # bytes from the slot's start (a multiple of WRITER_ALIGN)
    length: int  # bytes: num_layers * kv_parts * part_bytes
    part_bytes: int  # bytes of one (layer, part) run


class Chunk(NamedTuple):
    """Consecutive layers ``[layer_lo, layer_hi)`` of one writer's sub-slice."""

    index: int
    layer_lo: int
    layer_hi: int
    offset: int  # bytes from the slot's start
    length: int

    @property
    def layers(self) -> range:
        return range(self.layer_lo, self.layer_hi)


@dataclass(frozen=True)
class SlotLayout:
    """Where every writer's bytes go in one D rank's slot for one request (see module doc)."""

    num_layers: int
    kv_parts: int
    first_token: int
    num_tokens: int
    writers: tuple[WriterSlice, ...]  # in increasing rank order, disjoint, ascending offsets
    total_bytes: int  # bytes to reserve (the last writer's end)

    def writer(self, rank: int) -> WriterSlice:
        """The sub-slice of P rank ``rank``; GeometryError if that rank writes nothing here."""
        for w in self.writers:
            if w.rank == rank:
                return w
        raise GeometryError(f"producer rank {rank} writes nothing into this slot")

    def chunks(self, rank: int, layers_per_chunk: int) -> tuple[Chunk, ...]:
        """Writer ``rank``'s sub-slice cut into chunks of ``layers_per_chunk`` layers (the last
        may be shorter); empty when the token range is empty."""
        lpc = _as_count(layers_per_chunk, "layers_per_chunk")
        if lpc == 0:
            raise GeometryError("layers_per_chunk must be positive")
        w = self.writer(rank)
        if w.length == 0:
            return ()
        layer_bytes = self.kv_parts * w.part_bytes
        out = []
        for i, lo in enumerate(range(0, self.num_layers, lpc)):
            hi = min(lo + lpc, self.num_layers)
            out.append(Chunk(i, lo, hi, w.offset + lo * layer_bytes, (hi - lo) * layer_bytes))
        return tuple(out)


def _check_range(dst: KVGeometry, first_token: int, num_tokens: int) -> tuple[int, int]:
    first_token = _as_count(first_token, "first_token")
    num_tokens = _as_count(num_tokens, "num_tokens")
    if first_token % dst.block_size:
        raise GeometryError(
            f"first_token {first_token} is not a multiple of the decoder block size "
            f"{dst.block_size}")
    if first_token > num_tokens:
        raise GeometryError(f"first_token {first_token} is past num_tokens {num_tokens}")
    return first_token, num_tokens


def _opaque_part_bytes(geo: KVGeometry, first_token: int, num_tokens: int) -> int:
    """A run of whole blocks covering [first_token, num_tokens) (block-aligned first_token)."""
    n = num_tokens - first_token
    return -(-n // geo.block_size) * geo.block_bytes


def slot_layout(
    dst: KVGeometry, src_tp: int, *, first_token: int, num_tokens: int,
    align: int = WRITER_ALIGN,
) -> SlotLayout:
    """The slot D rank ``dst.tp_rank`` receives from a producer of TP size ``src_tp`` for tokens
    ``[first_token, num_tokens)``. Raises GeometryError on bad input.

    An empty token range gives ``total_bytes == 0`` (and zero-length writers): nothing to reserve,
    nothing to move. ``align`` is the writers' alignment inside the slot (the slot itself is
    aligned by the pool)."""
    dst.validate()
    check_head_split(dst.num_kv_heads, src_tp, "producer")
    first_token, num_tokens = _check_range(dst, first_token, num_tokens)
    if align <= 0:
        raise GeometryError(f"align must be positive, got {align}")
    if dst.token_order == "opaque" and src_tp != dst.tp_size:
        raise GeometryError(
            f"opaque block layouts need equal tp_size: {src_tp} at the producer, {dst.tp_size} here")
    writers = writer_ranks(dst.num_kv_heads, src_tp, dst.tp_size, dst.tp_rank)
    out, end = [], 0
    for rank, (lo, hi) in writers.items():
        if dst.token_order == "opaque":
            part = _opaque_part_bytes(dst, first_token, num_tokens)
        else:
            part = (num_tokens - first_token) * (hi - lo) * dst.vec_bytes
        length = dst.num_layers * dst.kv_parts * part
        offset = _round_up(end, align)
        out.append(WriterSlice(rank, (lo, hi), offset, length, part))
        end = offset + length
    return SlotLayout(num_layers=dst.num_layers, kv_parts=dst.kv_parts, first_token=first_token,
                      num_tokens=num_tokens, writers=tuple(out), total_bytes=end)


def slot_bytes(dst: KVGeometry, src_tp: int, *, first_token: int, num_tokens: int) -> int:
    """Bytes of the slot :func:`slot_layout` describes (what D reserves in its pool)."""
    return slot_layout(dst, src_tp, first_token=first_token, num_tokens=num_tokens).total_bytes


def layers_per_chunk(layer_bytes: int, num_layers: int, chunk_bytes: int) -> int:
    """Layers per chunk so that a chunk is at most ``chunk_bytes`` (at least one layer, at most
    ``num_layers``). ``layer_bytes`` is one writer's ``kv_parts * part_bytes``; use the largest
    writer's when they differ, so every chunk of the slot stays under the target."""
    layer_bytes = _as_count(layer_bytes, "layer_bytes")
    num_layers = _as_count(num_layers, "num_layers")
    chunk_bytes = _as_count(chunk_bytes, "chunk_bytes")
    if num_layers == 0 or chunk_bytes == 0:
        raise GeometryError("num_layers and chunk_bytes must be positive")
    if layer_bytes == 0:
        return num_layers
    return max(1, min(num_layers, chunk_bytes // layer_bytes))


# -- plans ---------------------------------------------------------------------------------------


class ViewSpec(NamedTuple):
    """A strided view of one (layer, part) of a cache: row ``r`` is the ``row_bytes`` bytes at
    ``part_base + offset + r * row_stride``. All ``rows`` rows lie inside the part's blocks
    (``(num_blocks - 1) * block_stride + block_bytes`` bytes from its base)."""

    offset: int
    row_stride: int
    row_bytes: int
    rows: int


class Segment(NamedTuple):
    """Rows of one view, in canonical order, filling ``nbytes`` bytes of every (layer, part) run
    starting at ``staging_offset``."""

    unit: str  # "block", "token" or "vector"
    view: ViewSpec
    rows: np.ndarray  # int64 row ids into ``view``
    staging_offset: int  # bytes from the start of a (layer, part) run
    first_row: int  # rows are first_row, first_row + 1, ... (a plain slice); -1 otherwise

    @property
    def nbytes(self) -> int:
        return int(self.rows.shape[0]) * self.view.row_bytes


@dataclass(frozen=True, eq=False)
class StagingPlan:
    """How one writer's sub-slice maps onto one side's cache (see module doc).

    The sub-slice is ``num_layers`` x ``kv_parts`` runs of ``part_bytes``; segments tile a run
    in order, without gaps. The same rows serve every layer and part.
    """

    side: str  # "gather" (P packs) or "scatter" (D unpacks)
    unit: str  # the coarsest unit among the segments (UNITS)
    segments: tuple[Segment, ...]
    num_layers: int
    kv_parts: int
    part_bytes: int
    word_bytes: int  # 1, 2, 4 or 8: divides every offset, stride, row and base address
    heads: tuple[int, int]  # global heads [lo, hi) moved
    first_token: int
    num_tokens: int

    @property
    def layer_bytes(self) -> int:
        return self.kv_parts * self.part_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def num_rows(self) -> int:
        """Rows moved per (layer, part): the number of copies an unfused op performs."""
        return sum(int(s.rows.shape[0]) for s in self.segments)

    def span(self, layers: range) -> tuple[int, int]:
        """(offset, length) in the sub-slice of the consecutive ``layers``."""
        _check_layers(layers, self.num_layers)
        return layers.start * self.layer_bytes, len(layers) * self.layer_bytes


def _check_layers(layers: range, num_layers: int) -> None:
    if not isinstance(layers, range) or layers.step != 1:
        raise GeometryError(f"layers must be a range with step 1, got {layers!r}")
    if not 0 <= layers.start <= layers.stop <= num_layers:
        raise GeometryError(f"layers {layers!r} outside [0, {num_layers})")


def _word_bytes(geo: KVGeometry, unit_bytes: int) -> int:
    g = math.gcd(unit_bytes, geo.block_stride, *(b for part in geo.part_bases for b in part))
    for w in (8, 4, 2):
        if g % w == 0:
            return w
    return 1


def _extent(geo: KVGeometry) -> int:
    return (geo.num_blocks - 1) * geo.block_stride + geo.block_bytes


def _view(geo: KVGeometry, offset: int, row_stride: int, row_bytes: int) -> ViewSpec:
    rows = (_extent(geo) - offset - row_bytes) // row_stride + 1
    return ViewSpec(offset, row_stride, row_bytes, rows)


def _segment(unit: str, view: ViewSpec, rows: np.ndarray, staging_offset: int) -> Segment:
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    n = rows.shape[0]
    first = -1
    if n and int(rows[-1]) - int(rows[0]) == n - 1 and (n == 1 or (np.diff(rows) == 1).all()):
        first = int(rows[0])
    return Segment(unit, view, rows, staging_offset, first)


def _side_plan(geo: KVGeometry, blocks: Sequence[int], *, side: str, origin: int,
               first_token: int, num_tokens: int, heads: tuple[int, int]) -> StagingPlan:
    """Plan for tokens [first_token, num_tokens) where blocks[j] holds tokens origin + j*bs..."""
    geo.validate()
    _check_addresses(geo, "producer" if side == "gather" else "decoder")
    name = "producer" if side == "gather" else "decoder"
    bs = geo.block_size
    blk = _block_ids(blocks, geo, name)
    lo, hi = (int(h) for h in heads)
    glo, ghi = geo.head_range
    if not glo <= lo < hi <= ghi:
        raise GeometryError(f"heads [{lo}, {hi}) are not a non-empty part of this rank's "
                            f"[{glo}, {ghi})")
    if geo.token_order == "opaque" and (lo, hi) != (glo, ghi):
        raise GeometryError("opaque blocks move whole: all of the rank's heads, not a slice")
    ntok = num_tokens - first_token
    need = -(-(num_tokens - origin) // bs) if ntok else 0
    if blk.shape[0] < need:
        raise GeometryError(
            f"tokens [{origin}, {num_tokens}) need {need} {name} blocks of {bs}, "
            f"got {blk.shape[0]}")
    if side == "scatter" and np.unique(blk[:need]).shape[0] != need:
        raise GeometryError("a decoder block id appears twice among the blocks being written")

    vec = geo.vec_bytes
    common = dict(side=side, num_layers=geo.num_layers, kv_parts=geo.kv_parts, heads=(lo, hi),
                  first_token=first_token, num_tokens=num_tokens)
    if ntok == 0:
        return StagingPlan(unit="block", segments=(), part_bytes=0,
                           word_bytes=_word_bytes(geo, vec), **common)

    if geo.token_order == "opaque":
        if (first_token - origin) % bs:
            raise GeometryError(
                f"opaque blocks move whole: token {first_token} does not start a block of {bs}")
        ids = blk[(first_token - origin) // bs: need]
        view = _view(geo, 0, geo.block_stride, geo.block_bytes)
        seg = _segment("block", view, ids, 0)
        return StagingPlan(unit="block", segments=(seg,), part_bytes=seg.nbytes,
                           word_bytes=_word_bytes(geo, geo.block_bytes), **common)

    nh = hi - lo
    h0 = lo - glo  # first written head, local index
    ts, hs = _order(geo)
    stride = geo.block_stride
    block_ok = nh == geo.local_heads and (nh == 1 or hs == 1) and (bs == 1 or ts == nh)
    token_ok = (nh == 1 or hs == 1) and (bs == 1 or stride % (ts * vec) == 0)
    block_ok = block_ok and token_ok  # partial blocks at either end go as token rows
    if stride % vec:
        raise GeometryError(f"block_stride {stride} is not a multiple of one vector ({vec} bytes)")
    row_bytes_tok = nh * vec
    tok_stride = stride if bs == 1 else ts * vec
    tok_view = _view(geo, h0 * hs * vec, tok_stride, row_bytes_tok) if token_ok else None

    def token_rows(t0: int, t1: int) -> np.ndarray:
        t = np.arange(t0, t1, dtype=np.int64) - origin
        j, o = np.divmod(t, bs)
        return (blk[j] * stride + o * (ts * vec)) // tok_stride

    segments: list[Segment] = []
    if block_ok:
        j0 = -(-(first_token - origin) // bs)  # first block wholly inside the range
        j1 = (num_tokens - origin) // bs  # one past the last
        if j0 < j1:
            b0, b1 = origin + j0 * bs, origin + j1 * bs
            off = 0
            if first_token < b0:
                segments.append(_segment("token", tok_view, token_rows(first_token, b0), off))
                off += segments[-1].nbytes
            blk_view = _view(geo, 0, stride, geo.block_bytes)
            segments.append(_segment("block", blk_view, blk[j0:j1], off))
            off += segments[-1].nbytes
            if b1 < num_tokens:
                segments.append(_segment("token", tok_view, token_rows(b1, num_tokens), off))
    if not segments and token_ok:
        segments.append(_segment("token", tok_view, token_rows(first_token, num_tokens), 0))
    if not segments:
        t = np.arange(first_token, num_tokens, dtype=np.int64) - origin
        j, o = np.divmod(t, bs)
        tok_base = (blk[j] * stride) // vec + o * ts  # in vectors
        h = np.arange(h0, h0 + nh, dtype=np.int64) * hs
        rows = (tok_base[:, None] + h[None, :]).ravel()
        segments.append(_segment("vector", _view(geo, 0, vec, vec), rows, 0))
    unit = min((s.unit for s in segments), key=UNITS.index)
    return StagingPlan(unit=unit, segments=tuple(segments), part_bytes=ntok * nh * vec,
                       word_bytes=_word_bytes(geo, vec), **common)


def gather_plan(src: KVGeometry, src_blocks: Sequence[int], *, first_token: int, num_tokens: int,
                heads: tuple[int, int]) -> StagingPlan:
    """P side (pack): global ``heads`` of tokens ``[first_token, num_tokens)`` from ``src``'s
    cache, where ``src_blocks[i]`` holds tokens ``[i*block_size, (i+1)*block_size)``.

    ``first_token`` may be anywhere (it is D's block size that it must be a multiple of);
    opaque geometries need it block-aligned here too. Raises GeometryError on bad input.
    """
    first_token = _as_count(first_token, "first_token")
    num_tokens = _as_count(num_tokens, "num_tokens")
    if first_token > num_tokens:
        raise GeometryError(f"first_token {first_token} is past num_tokens {num_tokens}")
    return _side_plan(src, src_blocks, side="gather", origin=0, first_token=first_token,
                      num_tokens=num_tokens, heads=heads)


def scatter_plan(dst: KVGeometry, dst_blocks: Sequence[int], *, first_token: int,
                 num_tokens: int, heads: tuple[int, int]) -> StagingPlan:
    """D side (unpack): global ``heads`` of tokens ``[first_token, num_tokens)`` into ``dst``'s
    cache, where ``dst_blocks[j]`` holds tokens ``[first_token + j*block_size, ...)``.

    ``first_token`` must be a multiple of ``dst.block_size`` and no block may be listed twice
    among those written. Raises GeometryError on bad input.
    """
    first_token, num_tokens = _check_range(dst, first_token, num_tokens)
    return _side_plan(dst, dst_blocks, side="scatter", origin=first_token,
                      first_token=first_token, num_tokens=num_tokens, heads=heads)


def pack_plan(src: KVGeometry, src_blocks: Sequence[int], dst: KVGeometry, *, first_token: int,
              num_tokens: int) -> StagingPlan | None:
    """P rank ``src.tp_rank``'s gather plan for D rank ``dst.tp_rank``'s slot, or None when it
    writes nothing there. Its ``total_bytes`` equals ``slot_layout(...).writer(rank).length``.
    """
    src.validate()
    dst.validate()
    src.compatible_with(dst)
    first_token, num_tokens = _check_range(dst, first_token, num_tokens)
    heads = writer_ranks(src.num_kv_heads, src.tp_size, dst.tp_size, dst.tp_rank).get(src.tp_rank)
    if heads is None:
        return None
    return gather_plan(src, src_blocks, first_token=first_token, num_tokens=num_tokens,
                       heads=heads)


def unpack_plans(src: KVGeometry, dst: KVGeometry, dst_blocks: Sequence[int], *,
                 first_token: int, num_tokens: int) -> dict[int, StagingPlan]:
    """D side: per writer P rank (slot order), the scatter plan of its sub-slice.

    ``src`` is any producer rank's geometry (its TP size and compatibility are what count).
    """
    src.validate()
    dst.validate()
    src.compatible_with(dst)
    first_token, num_tokens = _check_range(dst, first_token, num_tokens)
    writers = writer_ranks(dst.num_kv_heads, src.tp_size, dst.tp_size, dst.tp_rank)
    return {rank: scatter_plan(dst, dst_blocks, first_token=first_token, num_tokens=num_tokens,
                               heads=heads)
            for rank, heads in writers.items()}
