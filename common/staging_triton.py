"""Fused staging kernels (Triton): one launch per chunk, all layers and K/V parts of the chunk.

``staging_ops`` (torch) runs a plan as one ``index_select`` / ``index_copy_`` / slice copy per
(layer, part, segment): Qwen3-32B's 64 layers x K/V x 1-3 segments are 128-384 launches per side
per request, a fixed cost of milliseconds that dominates small requests. Here the same plan runs
as **one** Triton launch per chunk, whatever its layers, parts and segments; ``staging_ops``
stays the reference and the fallback (``select_kernels``).

How a plan becomes one launch (:class:`FusedPlan`)
--------------------------------------------------
A :class:`~kv_push.common.staging.StagingPlan`'s segments tile every (layer, part) run in
canonical order, each row ``row_bytes`` long. Every row is cut into *pieces* of ``piece`` words
(the largest divisor of the rows' common size that fits one tile; a word is
``plan.word_bytes``), so the run is ``n`` pieces back to back and piece ``k`` sits at
``k * piece`` words of the run. One int64 array holds each piece's word offset inside its
(layer, part) (the same for every layer and part); a second one holds every (layer, part)'s
base as a word offset from one reference address (the lowest base of the cache), so per-layer
allocations (vLLM's one tensor per layer) need no pointer array. Program ``(i, r)`` copies
pieces ``[i * ROWS, (i + 1) * ROWS)`` of run ``r`` of the chunk between the cache and the
staging bytes (gather for pack, scatter for unpack).

Index upload: both arrays go to the device once per plan (one pinned host buffer, one
``non_blocking`` copy on the ops' stream; an event orders the kernels after it). The bases are
a property of the geometry, so :class:`FusedCache` uploads them once per worker.

Kernel selection (:func:`select_kernels`): env ``KV_PUSH_STAGING_KERNELS`` = ``auto`` (default:
Triton on CUDA when ``triton`` imports, else torch) | ``triton`` | ``torch``; another value, or
``triton`` where it cannot run, is a :class:`ValueError` at start-up. On CPU tensors the Triton
kernels run only in Triton's interpreter (``TRITON_INTERPRET=1``): the tests use that.

Streams are as in ``staging_ops``: ops are enqueued on ``stream`` after ``wait_for`` events and
the plan's upload event; nothing synchronizes the device or the host.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
from typing import Any, Iterable, Sequence

import numpy as np

from .geometry import GeometryError, KVGeometry
from .staging import StagingPlan

__all__ = ["ENV", "KERNELS", "select_kernels", "triton_unavailable", "FusedCache", "FusedPlan",
           "pack", "unpack", "warmup"]

ENV = "KV_PUSH_STAGING_KERNELS"
KERNELS = ("auto", "triton", "torch")

#: words one program copies (ROWS pieces x piece words, about), and the widest piece
TILE_WORDS = 4096
MAX_PIECE_WORDS = 1024


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable(device_type: str) -> str | None:
    """Why the Triton kernels cannot run for ``device_type`` ("cuda" or "cpu"), or None."""
    try:
        importlib.import_module("triton")
    except Exception as e:  # noqa: BLE001 - any import failure means: not here
        return f"triton does not import ({type(e).__name__}: {e})"
    if device_type == "cuda":
        if _interpreted():
            return ("TRITON_INTERPRET is set: the interpreter runs kernels on host copies of "
                    "CUDA tensors, which the fused kernels' cross-allocation addressing cannot use")
        return None
    if device_type == "cpu" and _interpreted():
        return None
    return (f"Triton kernels run on CUDA memory (or on CPU tensors under TRITON_INTERPRET=1), "
            f"not on {device_type}")


def select_kernels(device_type: str, value: str | None = None) -> str:
    """``"triton"`` or ``"torch"``: which pack/unpack kernels a worker whose KV lives on
    ``device_type`` ("cuda" or "cpu") runs. ``value`` defaults to env ``KV_PUSH_STAGING_KERNELS``
    (unset or empty = ``auto``). Raises ValueError on a bad value, or on ``triton`` where the
    Triton kernels cannot run (``triton_unavailable``)."""
    raw = os.environ.get(ENV, "") if value is None else value
    choice = (raw or "auto").strip().lower()
    if choice not in KERNELS:
        raise ValueError(f"{ENV}={raw!r}: expected one of {', '.join(KERNELS)}")
    if choice == "torch":
        return "torch"
    why = triton_unavailable(device_type)
    if choice == "triton":
        if why:
            raise ValueError(f"{ENV}=triton but the Triton kernels cannot run here: {why}")
        return "triton"
    # auto: Triton on CUDA only (the interpreter on CPU is for tests, far slower than torch)
    return "triton" if device_type == "cuda" and why is None else "torch"


# -- the kernel ------------------------------------------------------------------------------------


def _kernel():
    return _build_kernel(_interpreted())


@functools.lru_cache(maxsize=None)
def _build_kernel(interpreted: bool):  # triton.jit picks the interpreter when it decorates
    import triton
    import triton.language as tl

    # the counts and offsets vary per request: no value specialization (one compile per
    # PIECE / HINT / direction, not per request size)
    @triton.jit(do_not_specialize=["n_pieces", "run_words", "base0"])
    def staging_copy(cache_ref, bases, offs, staging, n_pieces, run_words, base0,
                     PACK: tl.constexpr, PIECE: tl.constexpr, BLOCK_C: tl.constexpr,
                     ROWS: tl.constexpr, HINT: tl.constexpr):
        pid = tl.program_id(0)
        run = tl.program_id(1)  # (layer in chunk) * parts + part
        base = tl.load(bases + base0 + run)  # words from cache_ref to this (layer, part)
        r = pid * ROWS + tl.arange(0, ROWS)
        rmask = r < n_pieces
        src = tl.load(offs + r, mask=rmask, other=0)
        c = tl.arange(0, BLOCK_C)
        coff = base + src
        if HINT > 1:
            coff = tl.multiple_of(coff, HINT)
        cptr = cache_ref + (coff[:, None] + c[None, :])
        soff = run.to(tl.int64) * run_words + r.to(tl.int64) * PIECE
        if HINT > 1:
            soff = tl.multiple_of(soff, HINT)
        sptr = staging + (soff[:, None] + c[None, :])
        if BLOCK_C == PIECE:
            m = rmask[:, None]
        else:
            m = rmask[:, None] & (c[None, :] < PIECE)
        if PACK:
            tl.store(sptr, tl.load(cptr, mask=m), mask=m)
        else:
            tl.store(cptr, tl.load(sptr, mask=m), mask=m)

    return staging_copy


# -- plans ----------------------------------------------------------------------------------------


def _torch():
    import torch

    return torch


def _piece_words(row_words: Sequence[int]) -> int:
    g = 0
    for w in row_words:
        g = math.gcd(g, int(w))
    if g <= MAX_PIECE_WORDS:
        return max(g, 1)
    return max(d for d in range(1, MAX_PIECE_WORDS + 1) if g % d == 0)


def _upload(host: np.ndarray, device: Any, stream: Any):
    """``host`` (int64) on ``device``: one pinned buffer and one non_blocking copy on ``stream``
    (CUDA), or the array itself (CPU)."""
    torch = _torch()
    t = torch.from_numpy(np.ascontiguousarray(host, dtype=np.int64))
    if device.type != "cuda":
        return t
    with torch.cuda.stream(stream):
        return t.pin_memory().to(device, non_blocking=True)


class FusedCache:
    """One worker's cache for the fused kernels: a reference address and every (layer, part)'s
    base in words from it, per word size (uploaded once, on ``stream``)."""

    def __init__(self, geometry: KVGeometry, device: Any, *, stream: Any = None):
        from .staging_ops import _device, wrap_memory

        torch = _torch()
        geometry.validate()
        self.geometry = geometry
        self.device = _device(device)
        self.stream = stream
        if self.device.type == "cuda" and stream is None:
            self.stream = torch.cuda.current_stream(self.device)
        flat = [geometry.part_bases[p][layer] for layer in range(geometry.num_layers)
                for p in range(geometry.kv_parts)]  # index: layer * parts + part
        self.ref_addr = min(flat)
        self._flat = np.asarray(flat, dtype=np.int64) - self.ref_addr
        self._wrap = wrap_memory
        self._refs: dict[int, Any] = {}
        self._bases: dict[int, Any] = {}
        self.align16 = bool(self.ref_addr % 16 == 0 and (self._flat % 16 == 0).all())

    def ref(self, word_bytes: int):
        t = self._refs.get(word_bytes)
        if t is None:
            from .staging_ops import _word_dtype

            if self.ref_addr % word_bytes or (self._flat % word_bytes).any():
                raise GeometryError(f"the cache is not {word_bytes}-byte aligned")
            t = self._wrap(self.ref_addr, word_bytes, device=self.device).view(
                _word_dtype(word_bytes))
            self._refs[word_bytes] = t
        return t

    def bases(self, word_bytes: int):
        t = self._bases.get(word_bytes)
        if t is None:
            t = _upload(self._flat // word_bytes, self.device, self.stream)
            self._bases[word_bytes] = t
        return t


class FusedPlan:
    """A :class:`StagingPlan` as the fused kernel runs it: per-piece word offsets on the
    device (one upload), the piece size and the tile shape."""

    def __init__(self, plan: StagingPlan, cache: FusedCache, *, stream: Any = None):
        torch = _torch()
        self.plan = plan
        self.cache = cache
        self.device = cache.device
        g = cache.geometry
        if (plan.num_layers, plan.kv_parts) != (g.num_layers, g.kv_parts):
            raise GeometryError("the plan was made for another geometry (layers or parts differ)")
        w = plan.word_bytes
        self.word_bytes = w
        self.ready = None
        self.offs = None
        self.n_pieces = 0
        if not plan.segments:
            self.piece = 1
            return
        row_words = []
        for seg in plan.segments:
            v = seg.view
            if v.offset % w or v.row_stride % w or v.row_bytes % w:
                raise GeometryError(f"view {v} is not in {w}-byte words")
            row_words.append(v.row_bytes // w)
        piece = _piece_words(row_words)
        self.piece = piece
        parts = []
        for seg, rw in zip(plan.segments, row_words):
            v = seg.view
            starts = (v.offset + seg.rows.astype(np.int64) * v.row_stride) // w
            k = rw // piece
            if k > 1:
                starts = (starts[:, None] + np.arange(k, dtype=np.int64) * piece).ravel()
            parts.append(starts)
        offs = np.concatenate(parts)
        self.n_pieces = int(offs.shape[0])
        assert self.n_pieces * piece * w == plan.part_bytes, "segments do not tile the run"
        self.block_c = 1 << (piece - 1).bit_length()
        self.rows = max(1, TILE_WORDS // self.block_c)  # fixed per piece size: no recompiles
        hint = 1
        vw = 16 // w if w < 16 else 1
        if vw > 1 and cache.align16 and piece % vw == 0 and plan.part_bytes % 16 == 0 and \
                (offs % vw == 0).all():
            hint = vw
        self.hint = hint
        if self.device.type == "cuda":
            if stream is None:
                stream = cache.stream
            self.offs = _upload(offs, self.device, stream)
            cache.bases(w)  # uploaded once per worker, on the same stream
            self.ready = torch.cuda.Event()
            self.ready.record(stream)
        else:
            self.offs = _upload(offs, self.device, None)

    @property
    def run_words(self) -> int:
        return self.plan.part_bytes // self.word_bytes


def _launch_args(fplan: FusedPlan, words: Any, layers: range):
    cache = fplan.cache
    parts = fplan.plan.kv_parts
    w = fplan.word_bytes
    grid = (-(-fplan.n_pieces // fplan.rows), len(layers) * parts)
    args = (cache.ref(w), cache.bases(w), fplan.offs, words, fplan.n_pieces, fplan.run_words,
            layers.start * parts)
    meta = dict(PIECE=fplan.piece, BLOCK_C=fplan.block_c, ROWS=fplan.rows, HINT=fplan.hint,
                num_warps=4 if fplan.rows * fplan.block_c <= 2048 else 8)
    return grid, args, meta


def warmup(cache: FusedCache, staging: Any) -> int:
    """Compile (without running anything) the kernel variants this cache's common plans need --
    whole blocks of all local heads, and whole blocks with a partial one (token rows) -- both
    directions, so the JIT stays off the first request's critical path. ``staging`` is any
    uint8 tensor on the device (only its alignment matters). Returns the variants compiled;
    0 under the interpreter (nothing to compile)."""
    from .staging import gather_plan
    from .staging_ops import _word_dtype

    if _interpreted() or cache.device.type != "cuda":
        return 0
    g = cache.geometry
    n = 0
    seen = set()
    kernel = _kernel()
    for tokens in (2 * g.block_size, 2 * g.block_size - 1 if g.block_size > 1 else 1):
        try:
            plan = gather_plan(g, [0, 1] if g.num_blocks > 1 else [0], first_token=0,
                               num_tokens=min(tokens, g.block_size * min(2, g.num_blocks)),
                               heads=g.head_range)
        except GeometryError:
            continue
        fp = FusedPlan(plan, cache)
        key = (fp.piece, fp.hint, fp.word_bytes)
        if not fp.n_pieces or key in seen:
            continue
        seen.add(key)
        words = staging[: fp.word_bytes * 16].view(_word_dtype(fp.word_bytes))
        grid, args, meta = _launch_args(fp, words, range(1))
        for pack in (True, False):
            kernel.warmup(*args, grid=grid, PACK=pack, **meta)
            n += 1
    return n


def _run(fplan: FusedPlan, staging: Any, layers: range | None, stream: Any,
         wait_for: Iterable[Any], pack: bool):
    from .staging_ops import OpHandle, _word_dtype, check_staging

    torch = _torch()
    plan = fplan.plan
    w = fplan.word_bytes
    layers = check_staging(staging, plan, layers, fplan.device, w)
    cuda = fplan.device.type == "cuda"
    if cuda:
        if stream is None:
            stream = torch.cuda.current_stream(fplan.device)
    elif stream is not None:
        raise GeometryError("a stream is only meaningful for CUDA memory")
    if not len(layers) or not fplan.n_pieces:
        return OpHandle(None, launches=0)
    words = staging.view(_word_dtype(w))
    grid, args, meta = _launch_args(fplan, words, layers)
    meta["PACK"] = pack
    kernel = _kernel()
    if not cuda:
        kernel[grid](*args, **meta)
        return OpHandle(None, launches=1)
    with torch.cuda.stream(stream):
        for ev in wait_for:
            stream.wait_event(ev)
        if fplan.ready is not None:
            stream.wait_event(fplan.ready)
        kernel[grid](*args, **meta)
        done = torch.cuda.Event()
        done.record(stream)
    return OpHandle(done, launches=1)


def pack(plan: FusedPlan, staging: Any, layers: range | None = None, *, stream: Any = None,
         wait_for: Sequence[Any] = ()):
    """Gather ``layers`` (default: all) of a gather plan into ``staging`` in one launch (the
    contract of ``staging_ops.pack``)."""
    if plan.plan.side != "gather":
        raise GeometryError(f"pack needs a gather plan, got a {plan.plan.side} plan")
    return _run(plan, staging, layers, stream, wait_for, True)


def unpack(plan: FusedPlan, staging: Any, layers: range | None = None, *, stream: Any = None,
           wait_for: Sequence[Any] = ()):
    """Scatter ``layers`` of a scatter plan from ``staging`` into the cache in one launch."""
    if plan.plan.side != "scatter":
        raise GeometryError(f"unpack needs a scatter plan, got a {plan.plan.side} plan")
    return _run(plan, staging, layers, stream, wait_for, False)
