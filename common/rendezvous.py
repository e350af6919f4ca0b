"""Rendezvous: a decoder's registration meets the producer's prefill completion, in either order.

One table per producer worker, touched only by its transfer thread. Entries are keyed by the
router's transfer id. Each entry holds at most one prefill source (the producer request whose
blocks hold the prompt's KV) and, per decoder rank, the newest registration. Whichever of the
two arrives second makes a ``Pairing``: the producer then plans and issues the WRITE.

Attempts: a decoder that re-allocates (preemption, re-issue) registers again with a higher
``attempt``; that registration supersedes the older one. An event for an attempt older than the
newest one seen is stale: dropped and counted (``StaleEvent``). A second prefill source for the
same transfer id (the router re-issued the prefill) supersedes the first; the displaced source
is returned so its blocks can be released once nothing reads them.

Entries that never pair expire after ``ttl_s``; ``expire()`` returns them so the producer can
release the source's blocks (and tell the decoder, if one registered).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Source:
    """Producer side of a transfer: the finished prefill's blocks."""

    key: str  # what the engine knows the request by (its request id); released by this key
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class Registration:
    """Decoder side of a transfer: where one decoder rank wants the KV written."""

    transfer_id: str
    attempt: int
    peer: str  # decoder agent name
    engine_id: str
    tp_rank: int
    block_ids: tuple[int, ...]
    first_token: int
    num_tokens: int
    slot: Any = None  # messages.Slot: D reserved a staging slot for this registration


@dataclass(frozen=True)
class Pairing:
    source: Source
    registration: Registration


class StaleEvent(Exception):
    """An event for an attempt older than one already seen."""


@dataclass
class _Entry:
    created: float
    source: Source | None = None
    regs: dict[int, Registration] = field(default_factory=dict)  # by decoder tp_rank
    paired: set[int] = field(default_factory=set)  # decoder ranks already handed off


class Rendezvous:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError("rendezvous ttl must be positive")
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._entries

    def _entry(self, transfer_id: str) -> _Entry:
        entry = self._entries.get(transfer_id)
        if entry is None:
            entry = self._entries[transfer_id] = _Entry(created=self._clock())
        return entry

    def add_registration(self, reg: Registration) -> tuple[Pairing | None, Registration | None]:
        """Record ``reg``. Returns (pairing if the source is there, superseded registration)."""
        entry = self._entry(reg.transfer_id)
        old = entry.regs.get(reg.tp_rank)
        if old is not None:
            if reg.attempt < old.attempt or (
                reg.attempt == old.attempt and reg.engine_id == old.engine_id
            ):
                raise StaleEvent(
                    f"registration {reg.transfer_id} attempt {reg.attempt} from rank "
                    f"{reg.tp_rank}: attempt {old.attempt} already seen"
                )
        entry.regs[reg.tp_rank] = reg
        entry.paired.discard(reg.tp_rank)
        superseded = old
        if entry.source is None:
            return None, superseded
        entry.paired.add(reg.tp_rank)
        return Pairing(entry.source, reg), superseded

    def add_source(self, source: Source) -> tuple[list[Pairing], Source | None]:
        """Record a finished prefill. Returns (pairings, displaced older source)."""
        entry = self._entry(source.transfer_id)
        displaced = entry.source
        if displaced is not None and displaced.key == source.key:
            raise StaleEvent(f"prefill of {source.transfer_id} ({source.key}) reported twice")
        entry.source = source
        entry.paired.clear()
        pairings = [Pairing(source, reg) for reg in entry.regs.values()]
        entry.paired.update(entry.regs)
        return pairings, displaced

    def cancel(self, transfer_id: str, tp_rank: int, attempt: int) -> Registration | None:
        """Drop a decoder rank's registration (if ``attempt`` is its newest). Returns it."""
        entry = self._entries.get(transfer_id)
        if entry is None:
            return None
        reg = entry.regs.get(tp_rank)
        if reg is None:
            return None
        if attempt < reg.attempt:
            raise StaleEvent(
                f"cancel of {transfer_id} attempt {attempt}: attempt {reg.attempt} is current"
            )
        del entry.regs[tp_rank]
        entry.paired.discard(tp_rank)
        return reg

    def registrations(self, transfer_id: str) -> list[Registration]:
        entry = self._entries.get(transfer_id)
        return list(entry.regs.values()) if entry else []

    def source(self, transfer_id: str) -> Source | None:
        entry = self._entries.get(transfer_id)
        return entry.source if entry else None

    def drop(self, transfer_id: str) -> None:
        """Forget a transfer (done, failed or released)."""
        self._entries.pop(transfer_id, None)

    def drop_peer(self, peer: str) -> list[Registration]:
        """Forget every registration from ``peer`` (declared dead). Returns them."""
        dropped = []
        for entry in self._entries.values():
            for rank, reg in list(entry.regs.items()):
                if reg.peer == peer:
                    dropped.append(reg)
                    del entry.regs[rank]
                    entry.paired.discard(rank)
        return dropped

    def expire(self) -> list[tuple[str, Source | None, list[Registration]]]:
        """Remove entries older than ttl that never paired; returns what they held."""
        now = self._clock()
        out = []
        for tid, entry in list(self._entries.items()):
            if entry.paired or now - entry.created < self.ttl_s:
                continue
            out.append((tid, entry.source, list(entry.regs.values())))
            del self._entries[tid]
        return out
