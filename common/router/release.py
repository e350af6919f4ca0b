"""The router's release path: tell a prefill server (P) to drop the KV of exchanges that ended
without decode output.

In ``push`` mode P keeps each finished prefill's blocks until a decoder (D) registers for them,
cancels, or ``rendezvous_ttl_s`` (120 s by default) passes. When the router ends an exchange
before D produced any output -- the client hung up before D's first byte, D failed, P's leg
failed -- D's engine may never have seen the request, so no decoder will ever register or
cancel, and P would pin a whole prompt's KV per such request until the time-out: a client that
hangs up at once, again and again, could fill P's KV cache. So the router sends P a ``Release``
of that transfer id over P's side channel (``side_channel.release``): P frees at once what no
decoder has claimed and refuses later registrations of that id (see ``producer.py``).

How it goes (``ReleaseSender``):

* ``release(host, port, tid)`` only queues the id (per P side channel, at most ``max_pending``
  ids in all; more are dropped and counted: P's time-out still frees them) and makes sure one
  background task drains that P's queue. It never waits, so it never delays a client's response.
* The task sends up to ``MAX_RELEASE_IDS`` queued ids per ``Release``: a storm of hang-ups
  costs a few connections, not one per request. It dials the side channel the router was
  configured with (P's rank 0), whose ``ReleaseAck`` names every rank's port; the other ranks
  get the same ids, at once (each rank holds its own copy of a prefill).
* Each connection is a blocking socket exchange run in a worker thread, every socket operation
  bounded by ``timeout``. A P that is down, hangs or refuses costs that task its time-out; it is
  counted (``kv_push_router_release_errors_total{kind}``: connect, timeout, refused,
  bad_reply, internal) and logged once per P and kind per minute, and the ids are left to P's time-out.
* Authentication: with ``KV_PUSH_SECRET`` the frames carry the router's HMAC, bound to the nonce
  of P's ``Challenge`` on that connection, so a recorded Release cannot be replayed. Without a
  secret a Release is not authenticated (nor is anything else on the side channel).

Metrics: ``kv_push_router_releases_total{result}`` counts transfer ids by what became of them:
``sent`` (every rank acknowledged), ``failed`` (some rank was not told), ``dropped`` (the queue
was full).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kv_push.common.messages import MAX_RELEASE_IDS, Codec, ReleaseAck
from kv_push.common.metrics import LogLimiter
from kv_push.common.side_channel import ReleaseFailed, release

logger = logging.getLogger("kv_push.router")

#: ids waiting to be released, over every P, before new ones are dropped (counted)
DEFAULT_MAX_PENDING = 1 << 16

SendFn = Callable[[str, int, tuple[str, ...], Codec, float], ReleaseAck]


class ReleaseSender:
    """Queues released transfer ids per P side channel and sends them in the background.

    ``releases`` and ``errors`` are labelled Prometheus counters (``labels(result=...)``,
    ``labels(kind=...)``); ``send`` is ``side_channel.release`` (tests inject another).
    Single-threaded: call it from the event loop."""

    def __init__(self, codec: Codec, timeout: float, releases: Any, errors: Any, *,
                 max_pending: int = DEFAULT_MAX_PENDING, send: SendFn = release) -> None:
        if not timeout > 0:
            raise ValueError(f"release timeout must be positive, got {timeout!r}")
        self.codec, self.timeout = codec, timeout
        self.releases, self.errors = releases, errors
        self.max_pending = max_pending
        self._send = send
        self._queues: dict[tuple[str, int], list[str]] = {}
        self._tasks: dict[tuple[str, int], asyncio.Task] = {}
        self._pending = 0
        self._log = LogLimiter(logger)

    @property
    def pending(self) -> int:
        """Ids queued or being sent."""
        return self._pending

    def busy(self) -> bool:
        return any(not t.done() for t in self._tasks.values())

    def release(self, host: str, port: int, tid: str) -> None:
        """Queue ``tid`` for P's side channel ``host:port``; never waits."""
        if self._pending >= self.max_pending:
            self.releases.labels(result="dropped").inc()
            self._log.warn("dropped", "release queue full (%d transfer ids): transfer %s is "
                           "left to the prefill server's rendezvous_ttl_s", self.max_pending, tid)
            return
        key = (host, port)
        self._queues.setdefault(key, []).append(tid)
        self._pending += 1
        task = self._tasks.get(key)
        if task is None or task.done():
            self._tasks[key] = asyncio.ensure_future(self._drain(key))

    async def close(self) -> None:
        """Cancel the senders (at shutdown); a thread in a socket call ends at its time-out."""
        tasks = [t for t in self._tasks.values() if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    async def _drain(self, key: tuple[str, int]) -> None:
        queue = self._queues[key]
        try:
            while queue:
                batch = tuple(queue[:MAX_RELEASE_IDS])
                del queue[:len(batch)]
                try:
                    ok = await self._send_all(key, batch)
                finally:
                    self._pending -= len(batch)
                self.releases.labels(result="sent" if ok else "failed").inc(len(batch))
        finally:
            if not queue:
                self._queues.pop(key, None)
                self._tasks.pop(key, None)

    async def _send_one(self, host: str, port: int, batch: tuple[str, ...]
                        ) -> ReleaseAck | None:
        try:
            return await asyncio.to_thread(self._send, host, port, batch, self.codec,
                                           self.timeout)
        except ReleaseFailed as exc:
            kind = exc.kind
            self._log.warn(f"{host}:{port} {kind}", "release of %d transfer id(s) to the "
                           "prefill side channel %s:%d failed (%s): %s; they are left to its "
                           "rendezvous_ttl_s", len(batch), host, port, kind, exc)
        except Exception:  # a bug here must not take the router down: count it, log it
            kind = "internal"
            logger.exception("release of %d transfer id(s) to %s:%d failed", len(batch), host,
                             port)
        self.errors.labels(kind=kind).inc()
        return None

    async def _send_all(self, key: tuple[str, int], batch: tuple[str, ...]) -> bool:
        """Release ``batch`` on the P rank at ``key``, then on every other rank it names.
        True when every rank acknowledged."""
        host, port = key
        ack = await self._send_one(host, port, batch)
        if ack is None:
            return False
        others = [p for p in dict.fromkeys(ack.side_channel_ports) if p != port and 0 < p < 65536]
        acks = await asyncio.gather(*(self._send_one(host, p, batch) for p in others))
        return all(a is not None for a in acks)
