"""Rendezvous: decoders' registrations meet the producer's prefills, in either order.

One table per producer worker, touched only by its transfer thread. Pure bookkeeping: no
messages, no transport; the producer acts on what it returns.

Identity. vLLM turns one client request with a prompt list or ``n > 1`` into several engine
requests that share the router's transfer id (and its ``kv_transfer_params``), on P and on D
alike. They meet here under a **rendezvous key** ``(transfer id, prompt digest)`` -- both sides
see the same prompt token ids, so both compute the same digest:

* a **source** is one producer engine request's finished prefill (its blocks on this worker).
  It can serve ``capacity`` decoder requests (default 1; the router may send the prefill once
  for ``n`` samples and say ``fanout: n``). Identical prompts in one list simply form a pool of
  sources under one key. A source whose prefill failed (``failure``) pairs like any other, and
  each pairing fails at once.
* a **claim** is one decoder engine request, named by ``RequestKey`` = (decoder engine id, its
  registration id -- the decoder's request id). Each of its TP ranks sends a ``Registration``;
  a re-issued request keeps its key and raises ``attempt``, which supersedes the older attempt
  of that rank.

A claim is assigned to one source with capacity left when its first registration arrives (or,
if none has capacity, when a source arrives; waiting claims are served in arrival order), and
keeps it: every rank and every later attempt of that request pairs with that source. Each
(source, registration) is a ``Pairing`` the producer turns into a WRITE into *that*
registration's blocks; two claims never share blocks, so two decoder requests' WRITEs never land
in the same decoder blocks.

A claim is **complete** when every decoder rank this worker writes to (``targets``) is resolved
(written, failed, cancelled, or its decoder gone): the producer calls ``resolve``. A source is
**done** when all its capacity is assigned and every claim assigned to it is complete, or when it
has been here ``ttl_s`` (a decoder rank that never registers must not hold the prefill forever);
the producer then removes it (``remove_source``) once no WRITE reads it, and the claims go with
it. A claim that found no source within ``ttl_s`` expires (``expire``).

A source may also be **closed** (``close``): the router released its transfer id, so no further
decoder request will come for it. A closed source takes no more claims (its spare capacity is
gone) and is done once the claims it already has are complete -- at once when it has none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

#: (transfer id, prompt digest): what a prefill and a decoder request meet by
RdvKey = tuple[str, str]
#: (decoder engine id, registration id): one decoder engine request
RequestKey = tuple[str, str]


@dataclass(frozen=True)
class Source:
    """Producer side: one engine request's finished (or failed) prefill."""

    key: str  # what the engine knows the request by (its request id); released by this key
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    prompt_digest: str = ""
    capacity: int = 1  # decoder requests it may serve
    failure: str = ""  # non-empty: the prefill failed; every pairing with it fails with this
    abandoned: str = ""  # with ``failure``: it ended because its request did (TransferFailed)

    @property
    def rdv_key(self) -> RdvKey:
        return (self.transfer_id, self.prompt_digest)


@dataclass(frozen=True)
class Registration:
    """Decoder side: where one decoder rank wants one attempt of one request written."""

    transfer_id: str
    attempt: int
    peer: str  # decoder agent name
    engine_id: str
    tp_rank: int
    block_ids: tuple[int, ...]
    first_token: int
    num_tokens: int
    reg_id: str = ""  # the decoder's request id ("" = the transfer id, for callers without one)
    prompt_digest: str = ""
    slot: Any = None  # messages.Slot: D reserved a staging slot for this registration

    @property
    def rdv_key(self) -> RdvKey:
        return (self.transfer_id, self.prompt_digest)

    @property
    def request(self) -> RequestKey:
        return (self.engine_id, self.reg_id or self.transfer_id)

    @property
    def release_only(self) -> bool:
        """It asks for nothing: the decoder request ended first and only lets the prefill go."""
        return self.num_tokens <= self.first_token


@dataclass(frozen=True)
class Pairing:
    source: Source
    registration: Registration


class StaleEvent(Exception):
    """An event for an attempt older than (or equal to) one already seen, or seen twice."""


class ConflictEvent(Exception):
    """An event that contradicts what the table holds (another decoder engine, another key)."""


@dataclass
class Claim:
    """One decoder engine request (read-only outside this module)."""

    key: RequestKey
    rdv_key: RdvKey
    since: float
    targets: frozenset[int]  # decoder ranks this worker writes to
    regs: dict[int, Registration] = field(default_factory=dict)  # held registration per rank
    newest: dict[int, int] = field(default_factory=dict)  # rank -> newest attempt seen (even
    # cancelled: an attempt at or below it is stale, however late it arrives)
    resolved: set[int] = field(default_factory=set)
    source: str | None = None  # key of the assigned source

    @property
    def complete(self) -> bool:
        return self.targets <= self.resolved


@dataclass
class _Held:
    source: Source
    since: float
    assigned: list[RequestKey] = field(default_factory=list)
    expired: bool = False
    closed: bool = False  # released by the router: takes no more claims

    @property
    def spare(self) -> int:
        if self.expired or self.closed:
            return 0
        return self.source.capacity - len(self.assigned)


@dataclass
class _Entry:
    engine: str | None = None  # the decoder engine that registered under this key
    sources: dict[str, _Held] = field(default_factory=dict)  # in arrival order
    claims: dict[RequestKey, Claim] = field(default_factory=dict)  # in arrival order


class Rendezvous:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError("rendezvous ttl must be positive")
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[RdvKey, _Entry] = {}
        self._claims: dict[RequestKey, Claim] = {}
        self._where: dict[str, RdvKey] = {}  # source key -> its entry
        self._by_tid: dict[str, set[str]] = {}  # transfer id -> prompt digests with an entry

    # -- introspection -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rdv_key: RdvKey) -> bool:
        return rdv_key in self._entries

    def holds_failed(self) -> bool:
        """A failed prefill (``Source.failure``) waits here for the registrations it refuses."""
        return any(h.source.failure for e in self._entries.values() for h in e.sources.values())

    @property
    def num_claims(self) -> int:
        return len(self._claims)

    def claim(self, key: RequestKey) -> Claim | None:
        return self._claims.get(key)

    def sources(self, rdv_key: RdvKey) -> list[Source]:
        entry = self._entries.get(rdv_key)
        return [h.source for h in entry.sources.values()] if entry else []

    def spare(self, rdv_key: RdvKey) -> int:
        """How many more decoder requests the sources under ``rdv_key`` can take."""
        entry = self._entries.get(rdv_key)
        return sum(h.spare for h in entry.sources.values()) if entry else 0

    def source(self, source_key: str) -> Source | None:
        held = self._held(source_key)
        return held.source if held else None

    def registrations(self, rdv_key: RdvKey) -> list[Registration]:
        entry = self._entries.get(rdv_key)
        return [r for c in entry.claims.values() for r in c.regs.values()] if entry else []

    def _held(self, source_key: str) -> _Held | None:
        rdv_key = self._where.get(source_key)
        return self._entries[rdv_key].sources.get(source_key) if rdv_key else None

    def keys_of(self, transfer_id: str) -> list[RdvKey]:
        """The rendezvous keys of ``transfer_id`` that have an entry (one per prompt digest)."""
        return [(transfer_id, d) for d in self._by_tid.get(transfer_id, ())]

    def _entry(self, rdv_key: RdvKey) -> _Entry:
        entry = self._entries.get(rdv_key)
        if entry is None:
            entry = self._entries[rdv_key] = _Entry()
            self._by_tid.setdefault(rdv_key[0], set()).add(rdv_key[1])
        return entry

    def _drop_entry(self, rdv_key: RdvKey) -> None:
        del self._entries[rdv_key]
        digests = self._by_tid[rdv_key[0]]
        digests.discard(rdv_key[1])
        if not digests:
            del self._by_tid[rdv_key[0]]

    # -- events --------------------------------------------------------------------------------
    def add_source(self, source: Source) -> list[Pairing]:
        """Record a finished (or failed) prefill; returns the pairings with waiting claims."""
        if source.key in self._where:
            raise StaleEvent(f"prefill {source.key} of {source.transfer_id} reported twice")
        if source.capacity < 1:
            raise ValueError(f"source capacity must be at least 1, got {source.capacity}")
        entry = self._entry(source.rdv_key)
        held = entry.sources[source.key] = _Held(source, self._clock())
        self._where[source.key] = source.rdv_key
        pairings: list[Pairing] = []
        for claim in entry.claims.values():
            if held.spare == 0:
                break
            if claim.source is None:
                pairings += self._assign(claim, held)
        return pairings

    def _assign(self, claim: Claim, held: _Held) -> list[Pairing]:
        claim.source = held.source.key
        held.assigned.append(claim.key)
        return [Pairing(held.source, reg) for reg in claim.regs.values()]

    def _new_claim(self, key: RequestKey, rdv_key: RdvKey, engine_id: str,
                   targets: Iterable[int]) -> Claim:
        entry = self._entry(rdv_key)
        if entry.engine not in (None, engine_id):
            raise ConflictEvent(f"{rdv_key[0]} registered by decoder engines {entry.engine} "
                                f"and {engine_id}")
        entry.engine = engine_id
        claim = Claim(key, rdv_key, self._clock(), frozenset(targets))
        self._claims[key] = claim
        entry.claims[key] = claim
        return claim

    def add_registration(self, reg: Registration, targets: Iterable[int]
                         ) -> tuple[list[Pairing], Registration | None]:
        """Record ``reg`` (``targets``: the decoder ranks this worker writes to, used when it is
        the request's first). Returns (pairings to start now, the registration it superseded)."""
        claim = self._claims.get(reg.request)
        if claim is None:
            claim = self._new_claim(reg.request, reg.rdv_key, reg.engine_id, targets)
        elif claim.rdv_key != reg.rdv_key:
            raise ConflictEvent(f"request {reg.request[1]} registered for {claim.rdv_key} and "
                                f"then for {reg.rdv_key}")
        newest = claim.newest.get(reg.tp_rank, -1)
        if reg.attempt <= newest:
            raise StaleEvent(f"registration of {reg.request[1]} ({reg.transfer_id}) attempt "
                             f"{reg.attempt} from rank {reg.tp_rank}: attempt {newest} seen")
        old = claim.regs.get(reg.tp_rank)
        claim.newest[reg.tp_rank] = reg.attempt
        claim.regs[reg.tp_rank] = reg
        claim.resolved.discard(reg.tp_rank)
        if claim.source is not None:
            held = self._held(claim.source)
            assert held is not None  # a claim leaves with its source
            return [Pairing(held.source, reg)], old
        entry = self._entries[claim.rdv_key]
        for held in entry.sources.values():
            if held.spare > 0:
                return self._assign(claim, held), old
        return [], old

    def resolve(self, key: RequestKey, rank: int) -> None:
        """Decoder rank ``rank`` of request ``key`` can no longer be written by this worker."""
        claim = self._claims.get(key)
        if claim is not None:
            claim.resolved.add(rank)

    def cancel(self, key: RequestKey, rank: int, attempt: int, *, rdv_key: RdvKey,
               engine_id: str, targets: Iterable[int]) -> Registration | None:
        """The decoder gave up ``rank``'s attempt ``attempt``: drop that registration (if it is
        the newest) and resolve the rank. A cancel for a request never seen still creates its
        claim (resolved for ``rank``): its registration was lost or is late, and the claim must
        still take its share of a source so the source is released. Raises ``StaleEvent`` for an
        attempt older than the registration held (which stays)."""
        claim = self._claims.get(key)
        if claim is None:
            claim = self._new_claim(key, rdv_key, engine_id, targets)
            entry = self._entries[rdv_key]
            for held in entry.sources.values():
                if held.spare > 0:
                    self._assign(claim, held)
                    break
        reg = claim.regs.get(rank)
        if reg is not None and attempt < reg.attempt:
            raise StaleEvent(f"cancel of {key[1]} attempt {attempt}: attempt {reg.attempt} held")
        claim.newest[rank] = max(attempt, claim.newest.get(rank, -1))
        claim.regs.pop(rank, None)
        claim.resolved.add(rank)
        return reg

    def drop_peer(self, peer: str) -> list[Registration]:
        """Forget every registration from ``peer`` (gone); their ranks are resolved."""
        dropped = []
        for claim in self._claims.values():
            for rank, reg in list(claim.regs.items()):
                if reg.peer == peer:
                    dropped.append(reg)
                    del claim.regs[rank]
                    claim.resolved.add(rank)
        return dropped

    # -- endings -------------------------------------------------------------------------------
    def source_done(self, source_key: str) -> bool:
        """Nothing more will pair with this source: every unit of capacity went to a claim that
        is complete, or the source expired. (Whether a WRITE still reads it is the caller's.)"""
        held = self._held(source_key)
        if held is None:
            return False
        if held.expired:
            return True
        return held.spare == 0 and all(self._claims[k].complete for k in held.assigned)

    def remove_source(self, source_key: str) -> list[Claim]:
        """Forget a done source and the claims assigned to it (returned)."""
        rdv_key = self._where.pop(source_key)
        entry = self._entries[rdv_key]
        held = entry.sources.pop(source_key)
        gone = [self._claims.pop(k) for k in held.assigned]
        for claim in gone:
            del entry.claims[claim.key]
        if not entry.sources and not entry.claims:
            self._drop_entry(rdv_key)
        return gone

    def close(self, rdv_key: RdvKey) -> list[Source]:
        """No further decoder request will come for ``rdv_key`` (the router released its
        transfer): its sources take no more claims, so each is done once the claims it already
        has are complete. Claims still waiting for a source keep waiting (a prefill may still
        arrive for them). Returns the sources it closed (not those closed before)."""
        entry = self._entries.get(rdv_key)
        if entry is None:
            return []
        out = []
        for held in entry.sources.values():
            if not held.closed:
                held.closed = True
                out.append(held.source)
        return out

    def drop_waiting(self, rdv_key: RdvKey, drop: Callable[[Claim], bool]) -> list[Claim]:
        """Remove ``rdv_key``'s claims still waiting for a source for which ``drop`` is true;
        returns them."""
        entry = self._entries.get(rdv_key)
        if entry is None:
            return []
        out = []
        for key, claim in list(entry.claims.items()):
            if claim.source is None and drop(claim):
                del entry.claims[key]
                del self._claims[key]
                out.append(claim)
        if not entry.sources and not entry.claims:
            self._drop_entry(rdv_key)
        return out

    def retire(self, source_key: str) -> int:
        """``source_key`` takes no more claims and is done once no WRITE reads it, as if it had
        expired (a streamed prefill that failed: the claims it has are failed by the caller).
        Returns the capacity it had left."""
        held = self._held(source_key)
        if held is None:
            return 0
        spare = held.spare
        held.expired = True
        return spare

    def expire(self) -> tuple[list[Claim], list[Source]]:
        """Apply the time-out: claims that found no source within ``ttl_s`` are removed and
        returned; sources here for ``ttl_s`` take no more claims and are returned once (the
        caller removes each when no WRITE reads it; ``source_done`` is now true)."""
        now = self._clock()
        claims, sources = [], []
        for rdv_key, entry in list(self._entries.items()):
            for key, claim in list(entry.claims.items()):
                if claim.source is None and now - claim.since >= self.ttl_s:
                    del entry.claims[key]
                    del self._claims[key]
                    claims.append(claim)
            for held in entry.sources.values():
                if not held.expired and now - held.since >= self.ttl_s:
                    held.expired = True
                    sources.append(held.source)
            if not entry.sources and not entry.claims:
                self._drop_entry(rdv_key)
        return claims, sources
