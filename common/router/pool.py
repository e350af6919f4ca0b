"""The router's backends: one upstream server each, its in-flight legs, whether it can be
reached, and least-outstanding selection over a pool of them.

A :class:`Lease` is one leg's slot, taken when the pool picks a backend and given back with
:meth:`Lease.release` (idempotent), so a backend's ``outstanding`` count is exactly the legs that
were handed out and not yet released. Single-threaded: the router calls these from its event loop.

A backend the router could not connect to (refused, no route, connect time-out: nothing was
sent) is *down*: left out of selection for ``EJECT_BASE_S``, doubling with each further failure
once it is back in selection (failures while it is out do not lengthen it) up to ``EJECT_MAX_S``;
the first leg that connects to it again ends that. Without it, a dead
backend -- which fails at once and so always has the fewest outstanding legs -- would win
nearly every pick. When every backend is down, the one due back first is picked (the leg is
its probe).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_push.common.router.config import PrefillSpec

#: how long a backend that refused a connection is left out of selection; doubles per failure
EJECT_BASE_S = 1.0
EJECT_MAX_S = 30.0


def backoff_s(base: float, failures: int, cap: float) -> float:
    """``base`` doubled per failure in a row after the first, at most ``cap``. (The exponent is
    capped too: ``2.0 ** 1024`` overflows a float, and a backend down for hours fails that
    often.)"""
    return min(base * 2.0 ** min(max(0, failures - 1), 64), cap)


class Backend:
    """One configured upstream server, its count of in-flight legs, and whether it is down.

    ``gauge`` is anything with ``set(value)`` (the router passes a labelled Prometheus gauge).
    """

    def __init__(self, role: str, url: str, gauge: Any, spec: PrefillSpec | None = None) -> None:
        self.role, self.url, self.spec, self.outstanding = role, url, spec, 0
        self._gauge = gauge
        self.proxy: str | None = None  # the legs' proxy from the environment (Router.start)
        self.connect_failures = 0  # in a row
        self.ejections = 0  # back-offs in a row (the exponent: failures while out do not count)
        self.down_until = 0.0  # (monotonic) left out of selection until then
        #: (push, prefill) why its newest answer did not hold the prefill for a transfer
        #: (None: it did, or none came yet)
        self.not_held: str | None = None
        #: (push, prefill) why its side channel (kv=) did not answer the router's dial after a
        #: request D failed (None: it answered since, or no such failure)
        self.kv_unreachable: str | None = None
        #: (push, prefill) why its newest answer named a side channel other than its kv=
        #: (None: it did not, or named none)
        self.kv_mismatch: str | None = None
        #: (push, prefill) a decode server produced output through it: its kv= works (no
        #: kv_mismatch is flagged for it from then on)
        self.kv_proven = False
        gauge.set(0)

    def add(self, delta: int) -> None:
        self.outstanding += delta
        self._gauge.set(self.outstanding)

    def up(self, now: float) -> bool:
        return now >= self.down_until

    def unreachable(self, now: float) -> float:
        """A connection to it failed: down for the next back-off, unless it is out already
        (returns the seconds left). Failures that arrive while it is out -- legs sent before
        it was taken out, probes while every backend of its role is down -- do not lengthen
        it: six legs failing together pushed an outage from 1 s to the 30 s cap at once, so a
        restarted server stayed unused for 30 s."""
        self.connect_failures += 1
        if now >= self.down_until:
            self.ejections += 1
            self.down_until = now + backoff_s(EJECT_BASE_S, self.ejections, EJECT_MAX_S)
        return self.down_until - now

    def reachable(self) -> bool:
        """A leg connected to it: up again. True when it had been failing."""
        failing, self.connect_failures, self.down_until = self.connect_failures > 0, 0, 0.0
        self.ejections = 0
        return failing


class Lease:
    """One leg's slot on a backend, taken at selection; :meth:`release` is idempotent."""

    def __init__(self, backend: Backend) -> None:
        self.backend, self._held = backend, True
        backend.add(1)

    def release(self) -> None:
        if self._held:
            self._held = False
            self.backend.add(-1)


class BackendPool:
    """Least-outstanding selection among the backends that are up; ties go round robin (the
    scan starts one further each time)."""

    def __init__(self, backends: list[Backend], clock: Callable[[], float] = time.monotonic
                 ) -> None:
        if not backends:
            raise ValueError("a backend pool needs at least one backend")
        self.backends, self._next, self.clock = backends, 0, clock

    def acquire(self, avoid: Collection[str] = (), exclude: Collection[str] = ()
                ) -> Lease | None:
        """Take a slot on the backend with the fewest outstanding legs among those up and not
        in ``avoid`` (URLs: e.g. decoders known to be incompatible with the chosen prefill);
        failing that, among those up; failing that, the one due back first. Never one in
        ``exclude`` (URLs): None when nothing else is left."""
        n, now = len(self.backends), self.clock()
        start, self._next = self._next, (self._next + 1) % n
        order = [b for b in (self.backends[(start + k) % n] for k in range(n))
                 if b.url not in exclude]
        if not order:
            return None
        usable = ([b for b in order if b.up(now) and b.url not in avoid]
                  or [b for b in order if b.up(now)])
        if not usable:
            return Lease(min(order, key=lambda b: b.down_until))
        return Lease(min(usable, key=lambda b: b.outstanding))  # min keeps the first of equals
