"""The router's backends: one upstream server each, its in-flight legs, and least-outstanding
selection over a pool of them.

A :class:`Lease` is one leg's slot, taken when the pool picks a backend and given back with
:meth:`Lease.release` (idempotent), so a backend's ``outstanding`` count is exactly the legs that
were handed out and not yet released. Single-threaded: the router calls these from its event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_push.common.router.config import PrefillSpec


class Backend:
    """One configured upstream server and its count of in-flight legs.

    ``gauge`` is anything with ``set(value)`` (the router passes a labelled Prometheus gauge).
    """

    def __init__(self, role: str, url: str, gauge: Any, spec: PrefillSpec | None = None) -> None:
        self.role, self.url, self.spec, self.outstanding = role, url, spec, 0
        self._gauge = gauge
        self.proxy: str | None = None  # the legs' proxy from the environment (Router.start)
        gauge.set(0)

    def add(self, delta: int) -> None:
        self.outstanding += delta
        self._gauge.set(self.outstanding)


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
    """Least-outstanding selection; ties go round robin (the scan starts one further each time)."""

    def __init__(self, backends: list[Backend]) -> None:
        if not backends:
            raise ValueError("a backend pool needs at least one backend")
        self.backends, self._next = backends, 0

    def acquire(self) -> Lease:
        """Pick the backend with the fewest outstanding legs and take a slot on it."""
        n = len(self.backends)
        start, self._next = self._next, (self._next + 1) % n
        order = [self.backends[(start + k) % n] for k in range(n)]
        return Lease(min(order, key=lambda b: b.outstanding))  # min keeps the first of equals
