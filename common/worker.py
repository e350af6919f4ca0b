"""``PushWorker``: what one vLLM worker (one TP rank) runs -- the engine-facing API.

It wires the pieces together: the backend's checks, a NIXL transport with the KV memory
registered, the transfer thread with the producer and/or decoder role, and (producer) the
handshake side channel. Every engine-facing method only enqueues work for the transfer thread
and returns at once; results come back through thread-safe queues the engine drains:

* producer: ``prefill_done(...)``; ``released`` yields request keys whose blocks may be freed;
  the side channel also takes the router's ``Release`` (``_accept_release``: authenticated there,
  handed to the transfer thread here, answered at once);
* decoder: ``expect(...)``, ``cancel(key)``; ``outcomes`` yields ``Outcome`` records (and, with
  ``early_verdicts``, ``verdicts`` the failures decided before their blocks' fence ends).

Staging pools (``staged.py``): unless ``staged`` is "off", each role allocates its pool through
the backend (``alloc_staging``; size ``producer_staging_bytes`` / ``decoder_staging_bytes``, -1
meaning the backend's ``default_staging_bytes``) and registers it with the NIXL agent next to the
KV, before the agent's metadata is handed out. A pool the config sizes explicitly must be
allocated (else ``BackendError``); a default-sized one that cannot be is skipped with a warning.
A backend that does not stage at all (no ``alloc_staging``; Neuron today) is logged once per
worker with its ``staging_unsupported`` reason, which names where that is explained.

When the vLLM server the worker belongs to is gone (its API process killed alone: vLLM leaves
the engine and its workers running), the worker closes itself (``server_watch``): its peers see
it go, and its side-channel port is free for a server started in its place.

``describe()`` tells what the worker holds in detail (for diagnosing a leak); with
``KV_PUSH_STATE_LOG_S=N`` in the environment a worker logs it every N seconds while it holds
anything (the end-to-end suite sets it, and prints those lines when a server is left busy).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import uuid
from typing import Any, Callable

from .backend import BackendError, HostBackend, KVBackend
from .config import PushConfig
from .decoder import Decoder, Outcome
from .geometry import KVGeometry
from .messages import Release, ReleaseAck
from .metrics import Counters
from .producer import Producer
from .staged import StagedReceiver, StagedSender, StagingMemory, staging_unavailable
from .server_watch import ServerWatch
from .side_channel import SideChannelServer
from .transfer_thread import TransferThread
from .transport import NixlTransport, Transport

logger = logging.getLogger(__name__)

#: environment variable: seconds between state logs (``describe``) while a worker holds
#: anything; unset or 0: never
STATE_LOG_ENV = "KV_PUSH_STATE_LOG_S"
#: seconds between looks at whether this worker's vLLM server is still there (``server_watch``)
SERVER_WATCH_S = 1.0
#: environment variable: ``0`` turns that watch off (an application that runs vLLM's engine
#: under a process meant to exit while the engine serves on)
SERVER_WATCH_ENV = "KV_PUSH_SERVER_WATCH"


class PushWorker:
    def __init__(
        self,
        *,
        geometry: KVGeometry,
        role: str,
        config: PushConfig | None = None,
        engine_id: str | None = None,
        backend: KVBackend | None = None,
        transport_factory: Callable[[], Transport] | None = None,
        counters: Counters | None = None,
        early_verdicts: bool = False,
    ):
        """``early_verdicts``: the decoder also reports failures decided while their blocks
        stay fenced (``drain_verdicts``; the caller must drain them)."""
        if role not in ("producer", "decoder", "both"):
            raise ValueError(f"role must be producer, decoder or both, got {role!r}")
        geometry.validate()
        self.config = config or PushConfig()
        self.backend = backend or HostBackend()
        self.engine_id = engine_id or uuid.uuid4().hex
        self.geometry = geometry
        self.role = role
        self.counters = counters or Counters()
        self.backend.prepare(colocated=self.config.colocated)
        if transport_factory is None:
            backends = self._nixl_backends()
            transport_factory = lambda: NixlTransport(  # noqa: E731
                name=f"kvpush-{self.engine_id}-r{geometry.tp_rank}-{uuid.uuid4().hex[:8]}",
                backends=backends,
                progress_thread=self.backend.nixl_progress_thread)
        transport = transport_factory()
        transport.register(geometry.regions(), geometry.mem_type, geometry.dev_id)
        self.backend.verify_registration(geometry)
        self.staging: dict[str, StagingMemory] = {}
        self._told_no_staging = False
        for side in ("producer", "decoder"):
            if role in (side, "both"):
                mem = self._staging_pool(side, transport)
                if mem is not None:
                    self.staging[side] = mem
        self.thread = TransferThread(transport, engine_id=self.engine_id,
                                     tp_rank=geometry.tp_rank, geometry=geometry,
                                     config=self.config, counters=self.counters)
        self.released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.producer: Producer | None = None
        self.decoder: Decoder | None = None
        self.side_channel: SideChannelServer | None = None
        if role in ("producer", "both"):
            base = self.config.side_channel_port
            ports = tuple(base + r for r in range(geometry.tp_size))
            mem = self.staging.get("producer")
            self.producer = Producer(self.thread, on_released=self.released.put,
                                     side_channel_ports=ports,
                                     staged=StagedSender(self.thread, mem) if mem else None)
            self.thread.add_role(self.producer)
            self.side_channel = SideChannelServer(
                self.config.side_channel_host, base + geometry.tp_rank, self.thread.codec,
                on_hello=lambda hello: self.thread.call(
                    lambda: self.producer.accept_hello(hello), self.config.handshake_timeout_s),
                on_reject=lambda reason, detail: self.counters.reject(reason, detail,
                                                                      context="side channel"),
                timeout=self.config.handshake_timeout_s,
                on_closed=lambda hello: self.thread.peer_lost(
                    hello.agent_name, "decoder closed its side channel", lifeline=hello.nonce),
                on_held=lambda hello: self.thread.lifeline_held(hello.agent_name, hello.nonce),
                on_unsent=lambda hello: self.thread.peer_lost(
                    hello.agent_name, "its Welcome could not be sent", lifeline=hello.nonce,
                    held=False),
                max_connections=self.config.max_side_channel_connections,
                on_release=self._accept_release,
                on_release_reject=lambda reason, detail: self.counters.reject(
                    reason, detail, context="router release", counter="release_rejected"),
                on_probe=self._probed,
            )
            if self.side_channel.port != base + geometry.tp_rank:  # port 0: ephemeral
                self.producer.side_channel_ports = (self.side_channel.port,)
        if role in ("decoder", "both"):
            mem = self.staging.get("decoder")
            self.decoder = Decoder(
                self.thread, staged=StagedReceiver(self.thread, mem) if mem else None,
                early_verdicts=early_verdicts)
            self.thread.add_role(self.decoder)

    def _nixl_backends(self) -> tuple[str, ...]:
        """The configured NIXL backends, which must be able to register the backend's memory."""
        usable = tuple(self.backend.nixl_backends)
        if not self.config.nixl_backends:
            return usable[:1]
        chosen = tuple(b for b in self.config.nixl_backends if b in usable)
        if not chosen:
            raise BackendError(
                f"nixl_backends {self.config.nixl_backends} cannot register {self.backend.name} "
                f"memory; use {usable} (kv_connector_extra_config 'nixl_backends')")
        return chosen

    def _staging_pool(self, side: str, transport: Transport) -> StagingMemory | None:
        """Allocate and register ``side``'s staging pool (see the module doc), or None."""
        if self.config.staged == "off":
            return None
        key = f"{side}_staging_bytes"
        configured = getattr(self.config, key)
        nbytes = configured if configured >= 0 else int(
            getattr(self.backend, "default_staging_bytes", 0))
        alloc = getattr(self.backend, "alloc_staging", None)
        unsupported = None if alloc is not None else getattr(
            self.backend, "staging_unsupported", None)
        if nbytes == 0:
            if unsupported and not self._told_no_staging:
                self._told_no_staging = True
                logger.info("kv_push: staged transfers off (%s): region path only", unsupported)
            return None
        why = staging_unavailable() or (
            None if alloc is not None else unsupported or f"the {self.backend.name} backend "
            "cannot allocate staging memory")
        try:
            if why is not None:
                raise BackendError(why)
            addr, keep = alloc(nbytes, self.geometry.dev_id)
        except BackendError as e:
            if configured > 0:
                raise BackendError(f"{key}={configured}: {e} (set {key} to 0 or staged to "
                                   "off)") from None
            logger.warning("kv_push: no %s staging pool (%s): region path only", side, e)
            return None
        g = self.geometry
        transport.register([(addr, nbytes)], g.mem_type, g.dev_id)
        logger.info("kv_push: %s staging pool of %.2f GiB (%s, device %d) registered", side,
                    nbytes / 2**30, g.mem_type, g.dev_id)
        return StagingMemory(addr, nbytes, g.mem_type, g.dev_id, keep)

    @property
    def side_channel_address(self) -> tuple[str, int]:
        if self.side_channel is None:
            raise RuntimeError("only producers listen for handshakes")
        return self.side_channel.host, self.side_channel.port

    def start(self) -> "PushWorker":
        self.thread.start()
        for role in (self.producer, self.decoder):  # compile fused staging kernels ahead
            ops = getattr(getattr(role, "staged", None), "ops", None)
            if ops is not None and hasattr(ops, "warmup"):
                self.thread.submit(ops.warmup)
        if self.side_channel is not None:
            self.side_channel.start()
        every = float(os.environ.get(STATE_LOG_ENV) or 0)
        if every > 0:
            self._state_log = threading.Thread(target=self._log_state, args=(every,),
                                               name="kv-push-state-log", daemon=True)
            self._state_log.start()
        watch = ServerWatch() if os.environ.get(SERVER_WATCH_ENV, "1") != "0" else None
        if watch is not None and watch.watching:
            threading.Thread(target=self._watch_server, args=(watch,), name="kv-push-watch",
                             daemon=True).start()
        return self

    def _watch_server(self, watch: ServerWatch, every: float = SERVER_WATCH_S) -> None:
        """Close this worker once the vLLM server it belongs to is gone (``server_watch``): its
        peers see it go at once (goodbyes, closed lifelines) and its side-channel port is free
        for a server started in its place."""
        while not self._stop.wait(every):
            why = watch.gone()
            if why is not None:
                logger.error("kv_push: rank %d: the vLLM server of this engine is gone: %s. "
                             "Closing this worker (its peers see it go; its side channel is "
                             "freed). Stop a vLLM server by its process group so that its "
                             "engine goes too", self.geometry.tp_rank, why)
                self.close()
                return

    def _log_state(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                state = self.describe()
            except Exception as e:  # noqa: BLE001 - a diagnostic must never hurt the worker
                logger.warning("kv_push state (rank %d): unreadable: %r",
                               self.geometry.tp_rank, e)
                continue
            if any(state["counts"].values()):
                logger.warning("kv_push state (rank %d): %s", self.geometry.tp_rank, state)

    # -- producer --------------------------------------------------------------------------------
    def prefill_done(self, key: str, transfer_id: str, block_ids, num_tokens: int, *,
                     prompt_digest: str = "", capacity: int = 1) -> None:
        producer = self._need(self.producer, "prefill_done")
        ids = tuple(block_ids)  # a snapshot; ints are made on the transfer thread
        # staged: an event after the KV writes enqueued so far on this (the engine's) stream,
        # which the packs wait for on the device; recording it never blocks
        ready = producer.staged.marker() if producer.staged is not None else None
        self.thread.submit(lambda: producer.prefill_done(
            key, transfer_id, tuple(map(int, ids)), num_tokens, prompt_digest=prompt_digest,
            capacity=capacity, ready=ready))

    def prefill_failed(self, transfer_id: str, reason: str = "aborted", *,
                       prompt_digest: str = "", capacity: int = 1, key: str | None = None,
                       abandoned: str = "") -> None:
        """``key``: the engine request, when the engine holds its blocks until this worker
        reports it released (a streamed prefill). ``abandoned``: see ``Producer``."""
        producer = self._need(self.producer, "prefill_failed")
        self.thread.submit(lambda: producer.prefill_failed(
            transfer_id, reason, prompt_digest=prompt_digest, capacity=capacity, key=key,
            abandoned=abandoned))

    # -- producer: layer-wise streaming (``producer.py``) ---------------------------------------
    @property
    def streams(self) -> bool:
        """Whether ``prefill_started`` does anything here (a producer that stages, with
        ``layerwise`` not off)."""
        return (self.producer is not None and self.producer.staged is not None
                and self.config.layerwise != "off")

    def prefill_started(self, key: str, transfer_id: str, block_ids, num_tokens: int, *,
                        prompt_digest: str = "", capacity: int = 1) -> None:
        """(engine thread, before the step's forward) The step about to run completes the
        prefill of ``key`` into ``block_ids``; its KV is written layer by layer in this step.
        ``prefill_done`` must still follow, after the step."""
        if not self.streams:
            return
        producer = self.producer
        ids = tuple(block_ids)
        self.thread.submit(lambda: producer.prefill_started(
            key, transfer_id, tuple(map(int, ids)), num_tokens, prompt_digest=prompt_digest,
            capacity=capacity))

    def layer_saved(self, layer: int) -> None:
        """(engine thread) Layer ``layer``'s KV writes of this step were enqueued on the current
        stream (vLLM's ``save_kv_layer``): an event is recorded after them (never a sync) and
        the transfer thread packs that layer of every prefill the step streams."""
        if not self.streams:
            return
        producer = self.producer
        marker = producer.staged.marker()
        self.thread.submit(lambda: producer.layer_saved(layer, marker))

    def step_saved(self) -> None:
        """(engine thread) This step's forward enqueued all its KV writes (vLLM's
        ``wait_for_save``): layers no ``layer_saved`` reported are packed after them."""
        if not self.streams:
            return
        producer = self.producer
        marker = producer.staged.marker()
        self.thread.submit(lambda: producer.step_saved(marker))

    def _probed(self, peer: str) -> None:
        """A side-channel connection that read the challenge and closed without a frame: the
        router's ``/health?probe`` (or a decoder that died right after connecting, or a port
        scan). Counted, and logged with the peer at debug level."""
        self.counters.inc("side_channel_probes")
        logger.debug("kv_push: side-channel probe from %s (closed before a frame)", peer)

    def _accept_release(self, release: Release) -> ReleaseAck:
        """(side-channel thread) An authenticated ``Release`` from the router: hand it to the
        transfer thread (never waits for it) and answer with every rank's port."""
        producer = self._need(self.producer, "release")
        ids = tuple(release.transfer_ids)
        self.thread.submit(lambda: producer.release(ids))
        return ReleaseAck(accepted=len(ids), side_channel_ports=producer.side_channel_ports)

    def drain_released(self) -> list[str]:
        return _drain(self.released)

    # -- decoder ---------------------------------------------------------------------------------
    def expect(self, key: str, transfer_id: str, attempt: int, address: tuple[str, int],
               block_ids, first_token: int, num_tokens: int, *, prompt_digest: str = "") -> None:
        decoder = self._need(self.decoder, "expect")
        ids = tuple(block_ids)  # a snapshot; ints are made on the transfer thread
        self.thread.submit(lambda: decoder.expect(key, transfer_id, attempt, address,
                                                   tuple(map(int, ids)), first_token, num_tokens,
                                                   prompt_digest=prompt_digest))

    def cancel(self, key: str, reason: str = "aborted") -> None:
        decoder = self._need(self.decoder, "cancel")
        self.thread.submit(lambda: decoder.cancel(key, reason))

    def await_outcomes(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for an outcome or a verdict put since the last call
        (True if one was). It only waits; the caller drains the queues next."""
        return self._need(self.decoder, "await_outcomes").await_news(timeout)

    def drain_outcomes(self) -> list[Outcome]:
        decoder = self._need(self.decoder, "drain_outcomes")
        return _drain(decoder.outcomes)

    def drain_verdicts(self) -> list[Outcome]:
        """Failures decided while their blocks stay fenced (``early_verdicts``); each key's
        outcome follows once the fence ends."""
        decoder = self._need(self.decoder, "drain_verdicts")
        return _drain(decoder.verdicts)

    # -- both --------------------------------------------------------------------------------------
    def live(self, timeout: float = 5.0) -> dict[str, int]:
        """Live state counts (sources, jobs, wants, peers...), read on the transfer thread."""
        def read() -> dict[str, int]:
            out = {"peers": len(self.thread.peers)}
            for role in (self.producer, self.decoder):
                if role is not None:
                    out.update(role.live())
            return out
        return self.thread.call(read, timeout) if self.thread.alive else read()

    def describe(self, timeout: float = 5.0) -> dict[str, Any]:
        """What this worker holds, read on the transfer thread: per decoder want (not done) its
        key, registration id, transfer id, attempt, state, age, and per producer rank told what
        it owes (writes, WriteDone chunks seen / expected, chunks it answered for, dead); per
        producer the unreleased sources (key, transfer id), WRITE jobs, rendezvous entries and
        claims, WRITE handles to dead peers still in flight; ``counts``: each role's ``live()``
        (staging slots and rooms included)."""
        def read() -> dict[str, Any]:
            now = self.thread.clock()
            out: dict[str, Any] = {"peers": sorted(self.thread.peers), "counts": {}}
            for role in (self.producer, self.decoder):
                if role is not None:
                    out["counts"].update(role.live())  # every role's own count of what it holds
            if self.decoder is not None:
                d = self.decoder
                out["wants"] = [
                    {"key": w.key, "reg_id": w.reg_id, "tid": w.transfer_id,
                     "attempt": w.attempt, "state": w.state, "age_s": round(now - w.started, 1),
                     "told": {rank: {"writes": t.writes, "seen": len(t.seen),
                                     "chunks": t.chunks, "due": t.due, "dead": t.dead}
                              for rank, t in w.told.items()}}
                    for w in d.by_reg.values()]
                out["parked"] = len(d.parked)
            if self.producer is not None:
                p = self.producer
                out["sources"] = [(src.key, src.transfer_id) for src in p.sources.values()]
                out["jobs"] = [repr(k) for k in p.jobs]
                out["rendezvous"] = len(p.rdv)
                out["claims"] = p.rdv.num_claims
                out["orphans"] = len(p.orphans)
                out["released_tids"] = len(p.released_tids)
            return out
        return self.thread.call(read, timeout) if self.thread.alive else read()

    def close(self) -> None:
        self._stop.set()
        if self.side_channel is not None:
            self.side_channel.stop_listening()
        self.thread.close()  # drains the WRITEs in flight, tears the transport down
        if self.side_channel is not None and not self.thread.alive:
            # only now: a decoder frees its fenced blocks when our lifeline closes, so it must
            # not close while a WRITE of ours may still land in them (a thread that did not
            # stop in time may still have one: its lifelines close with the process)
            self.side_channel.close_lifelines(keep=self.thread.withheld)

    @staticmethod
    def _need(role, what: str):
        if role is None:
            raise RuntimeError(f"{what} needs a worker with that role")
        return role


def _drain(q: queue.SimpleQueue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
