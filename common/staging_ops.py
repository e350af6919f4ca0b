"""Pack and unpack staged KV with torch ops, on CPU or CUDA memory, from addresses alone.

torch is imported lazily (inside the functions), so importing this module costs nothing where
torch is absent; ``staging.py`` holds the pure index math these ops run.

* :func:`wrap_memory` -- a zero-copy 1-D ``uint8`` tensor over raw memory: host memory through
  ctypes + numpy (``torch.from_numpy``), CUDA memory through an object exposing
  ``__cuda_array_interface__`` (``torch.as_tensor(obj, device=...)``). Used for a worker's KV
  cache (from its :class:`KVGeometry`) and for a registered staging pool, so the core needs no
  tensor from vLLM. The caller keeps the memory alive and mapped while tensors over it are used.
* :class:`CacheViews` -- per (layer, part) strided views of a cache in units of a plan's rows
  (:class:`~kv_push.common.staging.ViewSpec`), built lazily and cached.
* :class:`DevicePlan` -- a plan's row ids copied to the device once (reusable for every chunk).
* :func:`pack` / :func:`unpack` -- one writer's sub-slice (or a chunk of its layers) between the
  cache and a staging byte tensor: ``index_select(..., out=)`` into / ``index_copy_`` out of the
  staging buffer per (layer, part, segment), or a plain slice ``copy_`` where a segment's rows are
  consecutive. They return an :class:`OpHandle`.

Streams and ordering (CUDA): ops are enqueued on ``stream`` (default: the device's current stream)
after it waits for every event in ``wait_for`` (e.g. one recorded on the compute stream after the
prefill's KV writes) and for the plan's index upload; nothing here synchronizes the device or the
host. The returned handle's ``query()`` says, without blocking, whether the ops completed (the
transfer thread polls it before posting a WRITE or reporting ``received``); ``event`` can be
waited on by another stream. On CPU the ops run synchronously and the handle is complete at once.

Memory-safety contract: a staging range must not be reused (or its slot released) before the
handle of every op touching it completed; a pack must not start before the KV it reads was
written (``wait_for``), an unpack not before the WRITE into its bytes completed.
"""

from __future__ import annotations

import ctypes
from typing import Any, Iterable, Sequence

import numpy as np

from .geometry import GeometryError, KVGeometry
from .staging import StagingPlan, ViewSpec, _check_layers

__all__ = ["wrap_memory", "CacheViews", "DevicePlan", "OpHandle", "pack", "unpack"]

_WORD_DTYPES = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _torch():
    import torch

    return torch


def _device(device: Any):
    """A torch.device with its index filled in for CUDA (so that devices compare equal)."""
    torch = _torch()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _word_dtype(word_bytes: int):
    return getattr(_torch(), _WORD_DTYPES[word_bytes])


class _CudaMemory:
    """Raw CUDA memory exposed as a 1-D uint8 array (no ownership, no stream sync)."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "strides": None,
            "version": 3,
        }


def wrap_memory(addr: int, nbytes: int, *, device: Any) -> Any:
    """A zero-copy 1-D ``uint8`` tensor over ``nbytes`` bytes at ``addr`` on ``device``
    (``"cpu"`` or a CUDA device). The memory must stay allocated while the tensor is used."""
    torch = _torch()
    device = torch.device(device)
    if addr <= 0 or nbytes <= 0:
        raise ValueError(f"cannot wrap {nbytes} bytes at address {addr:#x}")
    if device.type == "cpu":
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
        return torch.from_numpy(arr)
    if device.type == "cuda":
        t = torch.as_tensor(_CudaMemory(addr, nbytes), device=device)
        if t.data_ptr() != addr:  # as_tensor copied (e.g. the memory is on another device)
            raise ValueError(f"memory at {addr:#x} is not on {device}: it would be copied")
        return t
    raise ValueError(f"unsupported device {device} (cpu or cuda)")


class CacheViews:
    """Zero-copy strided views of one worker's KV cache, built from its geometry's addresses.

    ``device`` defaults to ``cpu`` for ``DRAM`` geometries and ``cuda:<dev_id>`` for ``VRAM``.
    ``keepalive`` may hold the tensors (or buffer) owning the memory, to tie their lifetime to
    these views. Not thread-safe: use it from the thread that runs the ops.
    """

    def __init__(self, geometry: KVGeometry, *, device: Any = None, keepalive: Any = None):
        geometry.validate()
        if device is None:
            device = "cpu" if geometry.mem_type == "DRAM" else f"cuda:{geometry.dev_id}"
        self.device = _device(device)
        self.geometry = geometry
        self._keepalive = keepalive
        self._bases: dict[tuple[int, int, int], Any] = {}
        self._views: dict[tuple[int, int, ViewSpec, int], Any] = {}

    def _base(self, layer: int, part: int, word_bytes: int):
        key = (layer, part, word_bytes)
        t = self._bases.get(key)
        if t is None:
            g = self.geometry
            extent = (g.num_blocks - 1) * g.block_stride + g.block_bytes
            addr = g.part_bases[part][layer]
            if addr % word_bytes or extent % word_bytes:
                raise GeometryError(f"layer {layer} part {part} is not {word_bytes}-byte aligned")
            t = wrap_memory(addr, extent, device=self.device).view(_word_dtype(word_bytes))
            self._bases[key] = t
        return t

    def view(self, layer: int, part: int, spec: ViewSpec, word_bytes: int):
        """``(spec.rows, spec.row_bytes // word_bytes)`` tensor of words over the rows of
        ``spec`` in (``layer``, ``part``)."""
        key = (layer, part, spec, word_bytes)
        v = self._views.get(key)
        if v is None:
            if spec.offset % word_bytes or spec.row_stride % word_bytes or \
                    spec.row_bytes % word_bytes:
                raise GeometryError(f"view {spec} is not in {word_bytes}-byte words")
            base = self._base(layer, part, word_bytes)
            v = base.as_strided((spec.rows, spec.row_bytes // word_bytes),
                                (spec.row_stride // word_bytes, 1),
                                base.storage_offset() + spec.offset // word_bytes)
            self._views[key] = v
        return v


class OpHandle:
    """Completion of enqueued pack/unpack ops. ``query()`` never blocks; ``event`` is the CUDA
    event recorded after the ops (None on CPU, where the ops already completed)."""

    def __init__(self, event: Any = None, launches: int = 0):
        self.event = event
        self.launches = launches  # kernels the ops enqueued (the staging_launches counter)

    def query(self) -> bool:
        return True if self.event is None else bool(self.event.query())

    def synchronize(self) -> None:
        """Block the calling thread until the ops completed (never call it on vLLM's engine
        thread; tests and benchmarks use it)."""
        if self.event is not None:
            self.event.synchronize()


class DevicePlan:
    """A :class:`StagingPlan` with its row ids on ``device`` (uploaded once, on ``stream``).

    Segments whose rows are consecutive need no ids (they run as slice copies).
    """

    def __init__(self, plan: StagingPlan, device: Any, *, stream: Any = None):
        torch = _torch()
        self.plan = plan
        self.device = _device(device)
        self.ready = None  # CUDA event after the uploads
        self.index: list[Any] = []
        if self.device.type == "cuda":
            if stream is None:
                stream = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(stream):
                for seg in plan.segments:
                    self.index.append(None if seg.first_row >= 0 else torch.from_numpy(
                        seg.rows).pin_memory().to(self.device, non_blocking=True))
                self.ready = torch.cuda.Event()
                self.ready.record(stream)
        else:
            for seg in plan.segments:
                self.index.append(None if seg.first_row >= 0 else torch.from_numpy(seg.rows))


def _check(views: CacheViews, plan: StagingPlan, staging: Any, layers: range | None,
           side: str) -> range:
    if plan.side != side:
        raise GeometryError(f"{'pack' if side == 'gather' else 'unpack'} needs a {side} plan, "
                            f"got a {plan.side} plan")
    g = views.geometry
    if (plan.num_layers, plan.kv_parts) != (g.num_layers, g.kv_parts):
        raise GeometryError("the plan was made for another geometry (layers or parts differ)")
    return check_staging(staging, plan, layers, views.device, plan.word_bytes)


def check_staging(staging: Any, plan: StagingPlan, layers: range | None, device: Any,
                  word_bytes: int) -> range:
    """The staging tensor for ``layers`` of ``plan`` (all when None) is a contiguous, aligned
    1-D uint8 tensor of exactly their bytes on ``device``; returns the layers. Shared by the
    torch ops and the fused kernels (``staging_triton``)."""
    torch = _torch()
    layers = range(plan.num_layers) if layers is None else layers
    _check_layers(layers, plan.num_layers)
    want = len(layers) * plan.layer_bytes
    if staging.dtype != torch.uint8 or staging.dim() != 1 or not staging.is_contiguous():
        raise GeometryError("staging must be a contiguous 1-D uint8 tensor")
    if staging.numel() != want:
        raise GeometryError(f"staging holds {staging.numel()} bytes, layers {layers!r} of this "
                            f"plan need {want}")
    if staging.device != device:
        raise GeometryError(f"staging is on {staging.device}, the cache on {device}")
    if staging.data_ptr() % word_bytes or staging.storage_offset() % word_bytes:
        raise GeometryError(f"staging is not {word_bytes}-byte aligned")
    return layers


def _run(views: CacheViews, plan: StagingPlan | DevicePlan, staging: Any, layers: range | None,
         stream: Any, wait_for: Iterable[Any], side: str) -> OpHandle:
    torch = _torch()
    dplan = plan if isinstance(plan, DevicePlan) else None
    splan = dplan.plan if dplan is not None else plan
    layers = _check(views, splan, staging, layers, side)
    cuda = views.device.type == "cuda"
    if cuda:
        if stream is None:
            stream = torch.cuda.current_stream(views.device)
    elif stream is not None:
        raise GeometryError("a stream is only meaningful for CUDA memory")
    if dplan is None:
        dplan = DevicePlan(splan, views.device, stream=stream)
    elif dplan.device != views.device:
        raise GeometryError(f"the plan's ids are on {dplan.device}, the cache on {views.device}")
    if not len(layers) or not splan.segments:
        return OpHandle(None)
    launches = len(layers) * splan.kv_parts * len(splan.segments)

    def body() -> None:
        w = splan.word_bytes
        words = staging.view(_word_dtype(w))
        parts = splan.kv_parts
        for i, layer in enumerate(layers):
            for p in range(parts):
                run0 = (i * parts + p) * splan.part_bytes
                for seg, idx in zip(splan.segments, dplan.index):
                    v = views.view(layer, p, seg.view, w)
                    n = seg.rows.shape[0]
                    rw = seg.view.row_bytes // w
                    lo = (run0 + seg.staging_offset) // w
                    buf = words[lo: lo + n * rw].view(n, rw)
                    if side == "gather":
                        if idx is None:
                            buf.copy_(v[seg.first_row: seg.first_row + n])
                        else:
                            torch.index_select(v, 0, idx, out=buf)
                    elif idx is None:
                        v[seg.first_row: seg.first_row + n].copy_(buf)
                    else:
                        v.index_copy_(0, idx, buf)

    if not cuda:
        body()
        return OpHandle(None, launches)
    with torch.cuda.stream(stream):
        for ev in wait_for:
            stream.wait_event(ev)
        if dplan.ready is not None:
            stream.wait_event(dplan.ready)
        for idx in dplan.index:
            if idx is not None:
                idx.record_stream(stream)  # allocator-owned: keep it until these ops ran
        body()
        done = torch.cuda.Event()
        done.record(stream)
    return OpHandle(done, launches)


def pack(views: CacheViews, plan: StagingPlan | DevicePlan, staging: Any,
         layers: range | None = None, *, stream: Any = None,
         wait_for: Sequence[Any] = ()) -> OpHandle:
    """Gather ``layers`` (default: all) of a gather plan from the cache into ``staging``.

    ``staging`` is a contiguous 1-D uint8 tensor on the cache's device holding exactly those
    layers' canonical bytes (``plan.span(layers)`` of the writer's sub-slice), aligned to
    ``plan.word_bytes``. Raises GeometryError on a mismatch; see the module doc for streams.
    """
    return _run(views, plan, staging, layers, stream, wait_for, "gather")


def unpack(views: CacheViews, plan: StagingPlan | DevicePlan, staging: Any,
           layers: range | None = None, *, stream: Any = None,
           wait_for: Sequence[Any] = ()) -> OpHandle:
    """Scatter ``layers`` of a scatter plan from ``staging`` (as for :func:`pack`) into the
    cache. Only the plan's tokens and heads are written; every other byte is left alone."""
    return _run(views, plan, staging, layers, stream, wait_for, "scatter")
