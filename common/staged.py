"""Staged transfers in the push path: the producer's sender and the decoder's receiver.

The region path WRITEs one NIXL descriptor per contiguous (layer, K/V, token run) straight into
D's blocks. The staged path moves the same bytes in three steps (``staging.py`` has the index
math, ``staging_ops.py`` the torch ops):

1. D owns a staging pool registered with its NIXL agent next to its KV and announces it in its
   ``Hello`` (``StagingRegion``); P answers in its ``Welcome`` whether it can stage (it owns a
   registered pool too). When D registers a request with a producer that stages, it reserves a
   *slot* sized by ``staging.slot_layout`` and sends it in ``Register.slot`` with the chunking
   (``layers_per_chunk``).
2. P (:class:`StagedSender`), once the registration and the prefill met, reserves room for its
   writer sub-slice in its own pool, packs the sub-slice chunk by chunk (groups of whole layers)
   into it -- on CUDA all chunks are enqueued at once on a side stream, ordered after the
   prefill's KV writes by the event ``PushWorker.prefill_done`` recorded on the engine's stream;
   on the host one chunk is packed right before it is posted -- and WRITEs each packed chunk as
   one descriptor into its place in D's slot, carrying a ``WriteDone(staged=True)`` that names
   the chunk and its layers. Pack completion is polled (``OpHandle.query``), never waited for.
3. D (:class:`StagedReceiver`) checks each notice against the slot layout and unpacks that chunk
   into its blocks (CUDA: a side stream) as it arrives. A writer rank has *arrived* only when all
   its chunks arrived and their unpacks completed; the decoder reports ``received`` after that.

Fallbacks (counted in ``staged_fallback{reason}``; the region path is always valid):

* ``no_slot``: D's pool has no free range large enough -- D registers without a slot;
* ``peer``: none of the producer ranks writing to D announced staging -- no slot;
* ``producer_pool``: P's pool has no room -- P takes the region path into D's blocks and D, seeing
  plain notices from that writer, unpacks nothing for it;
* ``bad_slot`` / ``error``: a slot that does not fit D's announced region or layout, or a plan or
  op that fails to build -- the region path (which reports a real mapping error itself);
* ``off``: D's staging was switched off at run time (``StagedReceiver.enabled``, benchmarks).

Opaque blocks (vLLM's CPU tiles) are packed as whole blocks, so -- as on the region path -- both
sides need the same geometry.

Lifetimes (the fencing rules apply to slots too):

* D releases a slot only when its want finishes (``Decoder._finish``), i.e. exactly when its
  blocks stop being fenced: ``received`` (all unpacks completed), or -- fenced after a cancel,
  a failure or a newer attempt -- once every writer is quiet (all chunks seen, or its answer's
  ``chunks_done`` notices seen, or proven dead) *and* no unpack is still running -- so a slot is
  never reused while a WRITE or an unpack may touch it. Chunks that arrive while a request is fenced are
  counted but not unpacked (its blocks are on their way back to the engine).
* P releases its room (and its source blocks) only when every posted WRITE finished and every
  enqueued pack completed -- also when D died or cancelled mid-way.

Threading: everything here runs on the transfer thread, except :meth:`StagedSender.marker`
(the engine thread records the ordering event; it never synchronizes). The ops are injected
(:class:`StagingOps`); :class:`TorchStagingOps` is the real one (fused Triton kernels or torch ops,
``staging_triton.select_kernels``), tests use fakes.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from .geometry import GeometryError, KVGeometry
from .messages import MessageRejected, Slot, StagingRegion, WriteDone
from .staging import Chunk, SlotLayout, StagingPlan, WriterSlice, gather_plan, layers_per_chunk
from .staging import pack_plan, slot_layout, unpack_plans
from .staging_pool import StagingPool

logger = logging.getLogger(__name__)

__all__ = ["StagingMemory", "StagingOps", "TorchStagingOps", "StagedSender", "StagedReceiver",
           "StagedSend", "Stream", "staging_unavailable"]

#: slot alignment inside a pool (and the pools' base alignment, see backend.STAGING_ALIGN)
SLOT_ALIGN = 4096


def staging_unavailable() -> str | None:
    """Why the staged path cannot run in this process (None when it can): the ops need torch."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not importable (the staged path packs and unpacks with torch ops)"
    return None


@dataclass
class StagingMemory:
    """One registered staging pool: ``nbytes`` at ``address`` of ``mem_type`` on ``dev_id``.
    ``keepalive`` owns the memory (a tensor or an array)."""

    address: int
    nbytes: int
    mem_type: str
    dev_id: int
    keepalive: Any = field(default=None, repr=False)


class StagingOps(Protocol):
    """Pack and unpack over one worker's cache and its staging pool (transfer thread only,
    except ``marker``). Handles have a non-blocking ``query() -> bool``."""

    #: True when ops run asynchronously (CUDA): the sender enqueues every chunk's pack at once.
    #: False: ops complete inside the call (host), so a chunk is packed right before its post.
    asynchronous: bool

    def prepare(self, plan: StagingPlan) -> Any:
        """The plan in the form the ops run (e.g. row ids on the device), built once."""

    def pack(self, prepared: Any, offset: int, nbytes: int, layers: range,
             wait_for: Sequence[Any]) -> Any:
        """Gather ``layers`` into the pool's bytes ``[offset, offset + nbytes)`` after the
        events ``wait_for``; returns a handle."""

    def unpack(self, prepared: Any, offset: int, nbytes: int, layers: range) -> Any:
        """Scatter ``layers`` from the pool's bytes ``[offset, offset + nbytes)``; a handle."""

    def marker(self) -> Any:
        """(any thread) An event after the work enqueued so far on the calling thread's stream
        (CUDA), or None when ops need no ordering (host)."""


class TorchStagingOps:
    """``StagingOps`` over a geometry's addresses and a pool, with the kernels
    ``staging_triton.select_kernels`` picks: the fused Triton kernels (``staging_triton``, one
    launch per chunk) or the per-layer torch ops (``staging_ops``, the reference).

    ``kernel``: ``"triton"`` | ``"torch"`` | None (select: env ``KV_PUSH_STAGING_KERNELS``, a bad
    value raises ValueError here, at start-up). ``counters``: where launches are counted
    (``staging_launches{kernel}``). Views, the staging tensor and (CUDA) the side stream are made
    on first use, on the thread that runs the ops."""

    def __init__(self, geometry: KVGeometry, memory: StagingMemory, *, kernel: str | None = None,
                 counters: Any = None):
        from .staging_triton import select_kernels

        self.geometry = geometry
        self.memory = memory
        self.asynchronous = memory.mem_type == "VRAM"
        self._device_type = "cuda" if geometry.mem_type == "VRAM" else "cpu"
        self.kernel = select_kernels(self._device_type, kernel)
        self.counters = counters
        self._views = None
        self._fused = None
        self._staging = None
        self._stream = None

    def _init(self) -> None:
        if self._views is not None:
            return
        import torch

        from .staging_ops import CacheViews, wrap_memory

        views = CacheViews(self.geometry)
        if views.device.type == "cuda":
            torch.cuda.set_device(views.device)  # this thread only
            self._stream = torch.cuda.Stream(views.device)
        self._staging = wrap_memory(self.memory.address, self.memory.nbytes, device=views.device)
        self._views = views
        self._ensure_fused()

    def _ensure_fused(self) -> None:
        """The fused kernels' per-cache state, once views exist and Triton is selected."""
        if self._views is not None and self.kernel == "triton" and self._fused is None:
            from .staging_triton import FusedCache

            self._fused = FusedCache(self.geometry, self._views.device, stream=self._stream)

    def warmup(self) -> int:
        """Compile the fused kernels' common variants now (transfer thread, at start-up), so
        the JIT does not land on the first request's critical path; 0 for torch or host."""
        if self.kernel != "triton" or not self.asynchronous:
            return 0
        self._init()
        from .staging_triton import warmup

        try:
            return warmup(self._fused, self._staging)
        except Exception:  # noqa: BLE001 - the first request compiles instead
            logger.exception("kv_push: compiling the staging kernels ahead failed")
            return 0

    def set_kernel(self, kernel: str) -> None:
        """Switch kernels (benchmarks compare both in one run): plans prepared before keep
        running with the kernels they were prepared for."""
        from .staging_triton import select_kernels

        self.kernel = select_kernels(self._device_type, kernel)
        self._ensure_fused()

    def prepare(self, plan: StagingPlan) -> Any:
        self._init()
        if self.kernel == "triton":
            from .staging_triton import FusedPlan

            return FusedPlan(plan, self._fused, stream=self._stream)
        from .staging_ops import DevicePlan

        return DevicePlan(plan, self._views.device, stream=self._stream)

    def _op(self, prepared, offset, nbytes, layers, waits, pack: bool):
        from .staging_triton import FusedPlan

        self._init()
        buf = self._staging[offset: offset + nbytes]
        if isinstance(prepared, FusedPlan):
            from . import staging_triton as ops
            label = "triton"
            handle = (ops.pack if pack else ops.unpack)(prepared, buf, layers,
                                                       stream=self._stream, wait_for=waits)
        else:
            from . import staging_ops as ops
            label = "torch"
            handle = (ops.pack if pack else ops.unpack)(self._views, prepared, buf, layers,
                                                       stream=self._stream, wait_for=waits)
        if self.counters is not None and handle.launches:
            self.counters.inc("staging_launches", handle.launches, label=label)
        return handle

    def pack(self, prepared, offset, nbytes, layers, wait_for):
        return self._op(prepared, offset, nbytes, layers,
                        [w for w in wait_for if w is not None], True)

    def unpack(self, prepared, offset, nbytes, layers):
        return self._op(prepared, offset, nbytes, layers, (), False)

    def marker(self) -> Any:
        if not self.asynchronous:
            return None
        import torch

        device = torch.device("cuda", self.geometry.dev_id)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event


def _desc(addr: int, length: int, dev_id: int) -> np.ndarray:
    return np.array([[addr, length, dev_id]], dtype=np.uint64)


# -- producer ------------------------------------------------------------------------------------


@dataclass(eq=False)
class Stream:
    """A prefill packed layer by layer while its step runs (layer-wise streaming): this rank's
    whole sub-slice for a decoder of the same TP size with no prefix of its own -- all local
    heads, tokens ``[0, num_tokens)`` -- in a room of P's pool, which the stream owns. Every
    registration whose writer sub-slice is exactly that is written from it (``attach``)."""

    key: str
    offset: int  # of the room in P's pool
    length: int
    plan: StagingPlan
    prepared: Any
    packs: dict = field(default_factory=dict)  # layer -> handle of the pack that covers it
    error: str = ""  # a pack failed: nothing more is packed or written from it
    complete: bool = False  # its prefill is complete (``prefill_done``) or ended (``failure``)
    failure: str = ""  # the prefill ended without output: pairings not yet written fail
    abandoned: str = ""  # with ``failure``: it ended because its request did (TransferFailed)


@dataclass(eq=False)
class StagedSend:
    """One registration's staged WRITE on the producer: its room in P's pool and its packs."""

    offset: int  # of the room in P's pool
    length: int  # the writer sub-slice's bytes
    writer: WriterSlice
    chunks: tuple[Chunk, ...]
    prepared: Any
    ready: Any  # the event the packs wait for (None on the host)
    packs: list = field(default_factory=list)  # handle per chunk packed or enqueued, in order
    error: str = ""
    #: written from a layer-wise ``Stream`` (whose room and packs it shares; the stream packs,
    #: and releases the room when it ends)
    stream: Stream | None = None

    def room(self, chunk: Chunk) -> tuple[int, int]:
        """(offset in P's pool, length) of ``chunk``'s packed bytes."""
        return self.offset + chunk.offset - self.writer.offset, chunk.length


class StagedSender:
    """The producer's side: D's announced regions, P's pool, packing, WRITE descriptors.

    The producer calls :meth:`start` when a registration with a slot meets its prefill, posts
    the chunk WRITEs :meth:`posts` built in order, each only once :meth:`packed` says its pack
    completed, and calls :meth:`finish` once no WRITE is in flight and :meth:`idle` is true.
    """

    def __init__(self, ctx, memory: StagingMemory, *, ops: StagingOps | None = None):
        self.ctx = ctx
        self.memory = memory
        self.pool = StagingPool(memory.nbytes, align=SLOT_ALIGN)
        self.ops = ops if ops is not None else TorchStagingOps(ctx.geometry, memory,
                                                                counters=ctx.counters)
        self.regions: dict[str, StagingRegion] = {}  # decoder agent -> its staging region
        self.ready: dict[str, Any] = {}  # source key -> event after its KV writes

    # -- peers and sources --------------------------------------------------------------------
    def accept(self, agent_name: str, region: StagingRegion | None) -> bool:
        """A decoder introduced itself; returns True (this producer stages)."""
        if region is None:
            self.regions.pop(agent_name, None)
        else:
            self.regions[agent_name] = region
        return True

    def forget_peer(self, agent_name: str) -> None:
        self.regions.pop(agent_name, None)

    def marker(self) -> Any:
        """(engine thread) The ordering event for a prefill that just finished."""
        return self.ops.marker()

    def note_ready(self, key: str, marker: Any) -> None:
        if marker is not None:
            self.ready[key] = marker

    def forget(self, key: str) -> None:
        self.ready.pop(key, None)

    # -- one registration ---------------------------------------------------------------------
    def _fallback(self, reason: str, detail: str = "") -> None:
        self.ctx.counters.inc("staged_fallback", label=reason)
        if detail:
            logger.info("kv_push: staged path not taken (%s): %s", reason, detail)

    def start(self, source, reg, peer) -> StagedSend | None:
        """Reserve room and start packing ``source`` for registration ``reg`` from ``peer``
        (a decoder rank); None when the region path must be taken (counted, except when this
        rank writes nothing to that decoder rank: the region path resolves that)."""
        slot: Slot | None = reg.slot
        if slot is None:
            return None
        g = self.ctx.geometry
        region = self.regions.get(peer.agent_name)
        if region is None:
            self._fallback("peer", f"{peer.engine_id} sent a slot but announced no staging")
            return None
        try:
            layout = slot_layout(peer.geometry, g.tp_size, first_token=reg.first_token,
                                 num_tokens=reg.num_tokens)
        except GeometryError as e:
            self._fallback("error", f"slot layout for {reg.transfer_id}: {e}")
            return None
        writer = next((w for w in layout.writers if w.rank == g.tp_rank), None)
        if writer is None or writer.length == 0:
            return None
        if slot.length < layout.total_bytes or slot.offset + slot.length > region.length:
            self.ctx.counters.reject("bad_slot", f"slot {slot} for {layout.total_bytes} bytes in "
                                     f"a region of {region.length}", context=peer.engine_id)
            self._fallback("bad_slot")
            return None
        try:
            chunks = layout.chunks(g.tp_rank, slot.layers_per_chunk)
            plan = pack_plan(g, source.block_ids, peer.geometry, first_token=reg.first_token,
                             num_tokens=reg.num_tokens)
        except GeometryError as e:
            self._fallback("error", f"pack plan for {reg.transfer_id}: {e}")
            return None
        if plan is None or plan.total_bytes != writer.length:
            self._fallback("error", f"pack plan for {reg.transfer_id} does not fill its slice")
            return None
        got = self.pool.reserve(writer.length)
        if got is None:
            self._fallback("producer_pool")
            return None
        try:
            prepared = self.ops.prepare(plan)
        except Exception as e:  # noqa: BLE001 - the region path still works
            self.pool.release(got[0])
            logger.exception("kv_push: preparing a pack plan failed")
            self._fallback("error", str(e))
            return None
        send = StagedSend(got[0], writer.length, writer, chunks, prepared,
                          self.ready.get(source.key))
        if self.ops.asynchronous:
            for c in chunks:
                if not self._pack(send, c):
                    break
        return send

    def _pack(self, send: StagedSend, chunk: Chunk) -> bool:
        off, n = send.room(chunk)
        try:
            send.packs.append(self.ops.pack(send.prepared, off, n, chunk.layers, (send.ready,)))
            return True
        except Exception as e:  # noqa: BLE001 - reported to D as a failed transfer
            logger.exception("kv_push: packing a staged chunk failed")
            send.error = f"packing chunk {chunk.index} failed: {e}"
            return False

    def posts(self, send: StagedSend, reg, peer) -> list[tuple[np.ndarray, np.ndarray, WriteDone]]:
        """Per chunk, in order: (src descs, dst descs, notice) of its WRITE (the producer seals
        the notice when it posts the WRITE)."""
        region = self.regions[peer.agent_name]
        out = []
        for c in send.chunks:
            off, n = send.room(c)
            notice = WriteDone(
                transfer_id=reg.transfer_id, reg_id=reg.request[1], attempt=reg.attempt,
                engine_id=self.ctx.engine_id,
                tp_rank=self.ctx.tp_rank, num_bytes=n, chunk=c.index, chunks=len(send.chunks),
                staged=True, layer_lo=c.layer_lo, layer_hi=c.layer_hi)
            out.append((_desc(self.memory.address + off, n, self.memory.dev_id),
                        _desc(region.base + reg.slot.offset + c.offset, n,
                              peer.geometry.dev_id), notice))
        return out

    # -- layer-wise streams --------------------------------------------------------------------
    def begin_stream(self, key: str, block_ids, num_tokens: int,
                     make_room: Any = None) -> Stream | None:
        """Reserve room for ``key``'s whole local sub-slice and prepare its gather plan; None
        (counted in ``layerwise_fallback{reason}``) when that cannot be done -- the prefill
        then takes the post-prefill path. ``make_room(nbytes)``: called once when the pool is
        full; returns whether it freed anything (then the reservation is tried again)."""
        g = self.ctx.geometry
        try:
            plan = gather_plan(g, block_ids, first_token=0, num_tokens=num_tokens,
                               heads=g.head_range)
        except GeometryError as e:
            self.ctx.counters.inc("layerwise_fallback", label="error")
            logger.info("kv_push: layer-wise stream of %s not started: %s", key, e)
            return None
        if plan.total_bytes == 0:
            return None
        got = self.pool.reserve(plan.total_bytes)
        if got is None and make_room is not None and make_room(plan.total_bytes):
            got = self.pool.reserve(plan.total_bytes)
        if got is None:
            self.ctx.counters.inc("layerwise_fallback", label="producer_pool")
            return None
        try:
            prepared = self.ops.prepare(plan)
        except Exception as e:  # noqa: BLE001 - the post-prefill path still works
            self.pool.release(got[0])
            logger.exception("kv_push: preparing a layer-wise pack plan failed")
            self.ctx.counters.inc("layerwise_fallback", label="error")
            return None
        return Stream(key, got[0], plan.total_bytes, plan, prepared)

    def pack_layers(self, stream: Stream, layers: range, marker: Any) -> None:
        """Pack the layers of ``layers`` not packed yet, after the event ``marker`` (their KV
        writes); consecutive ones in one op. A failure is kept in ``stream.error``."""
        if stream.error:
            return
        todo = [layer for layer in layers if layer not in stream.packs]
        while todo:
            lo = hi = todo[0]
            while hi + 1 in todo:
                hi += 1
            todo = [layer for layer in todo if layer > hi]
            run = range(lo, hi + 1)
            off, n = stream.plan.span(run)
            try:
                handle = self.ops.pack(stream.prepared, stream.offset + off, n, run, (marker,))
            except Exception as e:  # noqa: BLE001 - reported to D as a failed transfer
                logger.exception("kv_push: packing layers %s of a layer-wise stream failed", run)
                stream.error = f"packing layers [{lo}, {hi + 1}) failed: {e}"
                return
            for layer in run:
                stream.packs[layer] = handle

    def pack_rest(self, stream: Stream, marker: Any) -> None:
        self.pack_layers(stream, range(stream.plan.num_layers), marker)

    def attach(self, stream: Stream, reg, peer) -> StagedSend | None:
        """A send of ``stream``'s packed bytes into ``reg``'s slot, or None when that slot
        wants other bytes (other heads or tokens: a decoder of another TP size, or with a
        prefix of its own) or none (no slot, no staging region): the caller takes the
        post-prefill path then."""
        slot: Slot | None = reg.slot
        region = self.regions.get(peer.agent_name)
        if slot is None or region is None or stream.error:
            return None
        g = self.ctx.geometry
        try:
            layout = slot_layout(peer.geometry, g.tp_size, first_token=reg.first_token,
                                 num_tokens=reg.num_tokens)
            writer = layout.writer(g.tp_rank)
            chunks = layout.chunks(g.tp_rank, slot.layers_per_chunk)
        except GeometryError:
            return None
        plan = stream.plan
        if (writer.heads != plan.heads or (reg.first_token, reg.num_tokens) != (
                plan.first_token, plan.num_tokens) or writer.length != stream.length):
            return None
        if slot.length < layout.total_bytes or slot.offset + slot.length > region.length:
            return None  # the post-prefill path refuses and counts it
        return StagedSend(stream.offset, stream.length, writer, chunks, stream.prepared, None,
                          stream=stream)

    def stream_idle(self, stream: Stream) -> bool:
        """No pack of ``stream`` still runs (its source blocks and room are untouched)."""
        return all(h.query() for h in set(stream.packs.values()))

    def end_stream(self, stream: Stream) -> None:
        """Release ``stream``'s room (only once ``stream_idle``)."""
        self.pool.release(stream.offset)

    def packed(self, send: StagedSend, index: int) -> bool:
        """Whether chunk ``index`` is packed (host: packs it now). False on a failed pack
        (``send.error`` says why)."""
        if send.stream is not None:
            if send.stream.error:
                send.error = send.error or send.stream.error
                return False
            handles = [send.stream.packs.get(layer) for layer in send.chunks[index].layers]
            return None not in handles and all(h.query() for h in set(handles))
        if send.error:
            return False
        while len(send.packs) <= index:
            if self.ops.asynchronous or not self._pack(send, send.chunks[len(send.packs)]):
                return False
        return bool(send.packs[index].query())

    def idle(self, send: StagedSend) -> bool:
        """No pack of ``send`` is still running (its source blocks and room are untouched);
        a stream's packs are the stream's to wait for."""
        return send.stream is not None or all(h.query() for h in send.packs)

    def finish(self, send: StagedSend, ok: bool) -> None:
        """Release ``send``'s room (a stream's stays, the stream owns it); count it when every
        chunk was written (``ok``)."""
        if send.stream is None:
            self.pool.release(send.offset)
        elif ok:
            self.ctx.counters.inc("layerwise_transfers")
        if ok:
            self.ctx.counters.inc("staged_transfers")
            self.ctx.counters.inc("staged_chunks", len(send.chunks))
            self.ctx.counters.inc("staged_bytes", send.length)

    def live(self) -> int:
        return len(self.pool.reserved)


# -- decoder -------------------------------------------------------------------------------------

WantId = tuple[str, int]  # (reg id, attempt): one attempt of one decoder engine request


@dataclass(eq=False)
class _Landing:
    """One reserved slot on the decoder and what arrived in it."""

    offset: int
    length: int
    layout: SlotLayout
    chunks: dict[int, tuple[Chunk, ...]]  # writer rank -> its chunks
    prepared: dict[int, Any]  # writer rank -> its prepared scatter plan
    seen: dict[int, set[int]] = field(default_factory=dict)  # rank -> chunk indices arrived
    pending: list = field(default_factory=list)  # (rank, chunk, handle) unpacks in flight
    done: set[int] = field(default_factory=set)  # ranks reported complete
    skipped: set[int] = field(default_factory=set)  # ranks with chunks not unpacked (fenced)


class StagedReceiver:
    """The decoder's side: its pool and slots, chunk notices, unpacks.

    The decoder calls :meth:`reserve` before it registers, :meth:`on_chunk` per staged notice,
    :meth:`poll` every tick (writer ranks whose chunks all arrived and were unpacked), and
    :meth:`release` when the request's outcome goes out -- which it does only once
    :meth:`unpacking` is false.
    """

    def __init__(self, ctx, memory: StagingMemory, *, ops: StagingOps | None = None):
        self.ctx = ctx
        self.memory = memory
        self.pool = StagingPool(memory.nbytes, align=SLOT_ALIGN)
        self.ops = ops if ops is not None else TorchStagingOps(ctx.geometry, memory,
                                                                counters=ctx.counters)
        self.enabled = True  # a run-time switch (benchmarks compare paths in one run)
        self.producers: dict[str, bool] = {}  # producer agent -> it announced staging
        self.slots: dict[WantId, _Landing] = {}
        self._draining: list[_Landing] = []  # released while an unpack still ran (defensive)

    def region(self) -> StagingRegion:
        return StagingRegion(base=self.memory.address, length=self.memory.nbytes)

    def note_producer(self, agent_name: str, stages: bool) -> None:
        self.producers[agent_name] = bool(stages)

    def forget_producer(self, agent_name: str) -> None:
        self.producers.pop(agent_name, None)

    def _fallback(self, reason: str, detail: str = "") -> None:
        self.ctx.counters.inc("staged_fallback", label=reason)
        if detail:
            logger.info("kv_push: staged path not taken (%s): %s", reason, detail)

    def reserve(self, wid: WantId, writers: Sequence[str], src: KVGeometry,
                block_ids: Sequence[int], first_token: int, num_tokens: int) -> Slot | None:
        """A slot for request ``wid`` written by producer agents ``writers`` (``src``: any of
        their geometries), or None: register without one (the region path; counted)."""
        if num_tokens <= first_token or not writers:
            return None
        if not self.enabled:
            self._fallback("off")
            return None
        if not any(self.producers.get(a) for a in writers):
            self._fallback("peer")
            return None
        g = self.ctx.geometry
        try:
            layout = slot_layout(g, src.tp_size, first_token=first_token, num_tokens=num_tokens)
            plans = unpack_plans(src, g, block_ids, first_token=first_token,
                                 num_tokens=num_tokens)
            lpc = layers_per_chunk(max(w.length // g.num_layers for w in layout.writers),
                                   g.num_layers, self.ctx.config.staging_chunk_bytes)
            chunks = {w.rank: layout.chunks(w.rank, lpc) for w in layout.writers}
        except GeometryError as e:
            self._fallback("error", f"slot for {wid[0]}: {e}")
            return None
        got = self.pool.reserve(layout.total_bytes)
        if got is None:
            self._fallback("no_slot")
            return None
        try:
            prepared = {rank: self.ops.prepare(plan) for rank, plan in plans.items()}
        except Exception as e:  # noqa: BLE001 - the region path still works
            self.pool.release(got[0])
            logger.exception("kv_push: preparing unpack plans failed")
            self._fallback("error", str(e))
            return None
        self.slots[wid] = _Landing(got[0], got[1], layout, chunks, prepared)
        return Slot(offset=got[0], length=got[1], layers_per_chunk=lpc)

    def on_chunk(self, wid: WantId, rank: int, msg: WriteDone, *, unpack: bool) -> None:
        """A staged notice from writer ``rank``: check it against the slot and (``unpack``)
        start unpacking its chunk. Raises ``MessageRejected`` for a notice that does not fit
        (no slot, wrong chunk, a duplicate) or an unpack that cannot be started."""
        land = self.slots.get(wid)
        if land is None:
            raise MessageRejected("unexpected", f"staged notice for {wid[0]}, which has no slot")
        chunks = land.chunks.get(rank)
        if chunks is None:
            raise MessageRejected("unexpected", f"staged notice from non-writer rank {rank}")
        if msg.chunks != len(chunks):
            raise MessageRejected("invalid", f"staged notice says {msg.chunks} chunks, the slot "
                                  f"has {len(chunks)}")
        c = chunks[msg.chunk]
        if (msg.layer_lo, msg.layer_hi, msg.num_bytes) != (c.layer_lo, c.layer_hi, c.length):
            raise MessageRejected("invalid", f"staged chunk {msg.chunk}: layers [{msg.layer_lo}, "
                                  f"{msg.layer_hi}) {msg.num_bytes} bytes, the slot says "
                                  f"[{c.layer_lo}, {c.layer_hi}) {c.length} bytes")
        seen = land.seen.setdefault(rank, set())
        if msg.chunk in seen:
            raise MessageRejected("invalid", f"staged chunk {msg.chunk} from rank {rank} twice")
        seen.add(msg.chunk)
        if not unpack:
            land.skipped.add(rank)
            return
        try:
            handle = self.ops.unpack(land.prepared[rank], land.offset + c.offset, c.length,
                                     c.layers)
        except Exception as e:  # noqa: BLE001 - the request fails, the thread lives on
            logger.exception("kv_push: unpacking a staged chunk failed")
            raise MessageRejected("staging", f"unpacking chunk {msg.chunk} of rank {rank} "
                                  f"failed: {e}") from None
        land.pending.append((rank, c, handle))

    def staged_from(self, wid: WantId, rank: int) -> bool:
        """Whether writer ``rank`` already sent staged notices for ``wid``."""
        land = self.slots.get(wid)
        return land is not None and bool(land.seen.get(rank))

    def poll(self) -> list[tuple[WantId, list[int]]]:
        """Unpacks that completed since the last call; per slot that changed, the writer ranks
        that are now complete (all chunks arrived, none still unpacking)."""
        if self._draining:
            self._draining = [d for d in self._draining if not self._drain(d)]
        out = []
        for wid, land in self.slots.items():
            changed = False
            if land.pending:
                still = []
                for rank, c, h in land.pending:
                    if h.query():
                        changed = True
                        self.ctx.counters.inc("staged_chunks")
                        self.ctx.counters.inc("staged_bytes", c.length)
                    else:
                        still.append((rank, c, h))
                land.pending = still
            busy = {rank for rank, _, _ in land.pending}
            newly = [rank for rank, seen in land.seen.items()
                     if rank not in land.done and rank not in busy
                     and len(seen) == len(land.chunks[rank])]
            for rank in newly:
                land.done.add(rank)
                if rank not in land.skipped:
                    self.ctx.counters.inc("staged_transfers")
            if changed or newly:
                out.append((wid, newly))
        return out

    def unpacking(self, wid: WantId) -> bool:
        land = self.slots.get(wid)
        return land is not None and bool(land.pending)

    def _drain(self, land: _Landing) -> bool:
        land.pending = [p for p in land.pending if not p[2].query()]
        if land.pending:
            return False
        self.pool.release(land.offset)
        return True

    def release(self, wid: WantId) -> None:
        """The request's outcome went out: its slot may be reused (once no unpack runs)."""
        land = self.slots.pop(wid, None)
        if land is None:
            return
        if land.pending:  # the decoder waits for unpacks first; never reuse a busy slot anyway
            logger.error("kv_push: slot of %s released while unpacking; kept until done", wid[0])
            self._draining.append(land)
            return
        self.pool.release(land.offset)

    def busy(self) -> bool:
        """Unpacks are running, or a slot has some of a writer's chunks and waits for the rest
        (they follow within milliseconds: the decoder spins for them rather than sleeping
        ``idle_poll_s`` between notices)."""
        return bool(self._draining) or any(
            land.pending or any(0 < len(seen) < len(land.chunks[rank])
                                and rank not in land.skipped
                                for rank, seen in land.seen.items())
            for land in self.slots.values())

    def live(self) -> int:
        return len(self.pool.reserved)
