"""OpenAI-compatible HTTP router in front of prefill (P) and decode (D) vLLM servers.

Run ``kv-push-router --prefill URL,kv=HOST:PORT --decode URL [--mode push|pull|upstream-push]``
(see :mod:`kv_push.common.router_config`), or build the app in-process with :func:`build_app`.

Per ``POST /v1/completions`` / ``/v1/chat/completions`` the router picks one P and one D by least
outstanding requests (ties: round robin), makes a transfer id ``tid`` (``uuid4().hex``, also the
``X-Request-Id`` of both legs) and dispatches by ``--mode``. The P leg is always the client's
body with ``max_tokens=1`` (``max_completion_tokens=1`` if present), ``stream=false``, without
``stream_options``/``min_tokens``; the D leg is the body with only ``kv_transfer_params`` set.

``push`` (this project's connector): both legs at once; P gets ``{"transfer_id",
"do_remote_decode"}``, D ``{"transfer_id", "do_remote_prefill", "remote_host", "remote_port"}``
(P's side channel); with ``KV_PUSH_SECRET`` (or ``KV_PUSH_SECRET_FILE``) in the router's
environment both are signed (``kv_push_sig``, :mod:`kv_push.common.auth`). D's response is the
client's. A P failure before D's first byte cancels D and goes to the client (502 connect error,
504 timeout, else the upstream status; OpenAI-style body); a D failure cancels P; a P failure
after D's first byte is only counted (``kv_push_router_late_prefill_failures_total``), as D has
its own failure handling.

``pull`` (vLLM ``NixlConnector``, as vLLM's example proxy does it): P first with
:data:`PULL_PREFILL_PARAMS`, then D with the ``kv_transfer_params`` of P's JSON response verbatim
(pull_scheduler.py ``request_finished``: remote_engine_id, remote_block_ids, remote_host, ...).

``upstream-push`` (vLLM 0.32 ``NixlPushConnector``; files under
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``):

* P reads only ``do_remote_decode`` (push_scheduler.py:147, :226); we send the pull P dict.
* D reads ``do_remote_prefill`` (push_scheduler.py:119, :157), ``remote_engine_id``,
  ``remote_host``, ``remote_port``, ``tp_size`` (indexed without default, :184-187: a missing key
  is a KeyError in D's scheduler) and ``pp_size`` (default 1, :188). No block ids: D sends P a
  PUSH_REG NIXL notification with its own blocks and P WRITEs into them.
* ``remote_engine_id`` must be P's real engine id (D's handshake rejects a mismatch,
  base_worker.py:1112). vLLM draws it at random per start (config/kv_transfer.py:112; ``_dp<rank>``
  appended with DP, v1/engine/utils.py:488), so unless ``--prefill ...,engine_id=ID`` is given the
  router learns it (and tp/pp) from the ``kv_transfer_params`` P returns (push_scheduler.py:281-293,
  ``transfer_mode="push"``): a P's requests go serially until its id is known, then
  concurrently, re-learning on every P response (restarts). A serial D leg gets the same params
  as a concurrent one, not P's verbatim: P's verbatim params carry ``remote_request_id``, which
  turns on D's heartbeats (base_scheduler.py:199-236), and D's first heartbeat starts a full
  handshake with P (base_worker.py:3185, not notif-only) that D's PUSH_REG then waits on
  (``_ensure_handshake`` shares one future per engine). On this 2-core box that handshake
  finished only as P's 30 s lease ran out ("Releasing expired KV blocks ... retrieved by 0 remote
  worker(s)"), so P never wrote and D hung (why it took so long was not found). Without
  heartbeats D's notif-only handshake (push_worker.py:328-338) was usually quicker, but under
  heavy load (load average ~19 on 2 cores) a serial first request still hung the same way once:
  D's leg starts only after P's 30 s lease has begun. Give ``engine_id=`` to skip that phase.
* Concurrent legs are supported: P parks whichever of its finished blocks / D's registration
  comes first (push_worker.py:255-264, :297-313). They match by request id with vLLM's random
  ``-xxxxxxxx`` suffix stripped (push_worker.py:398-428, utils.py:62-67). Those ids are
  ``cmpl-{X-Request-Id}-{i}-{rand8}`` (completion/serving.py:141,177; input_processor.py:371) and
  ``chatcmpl-{X-Request-Id}-{rand8}`` (chat_completion/serving.py:315), so both legs must use the
  same endpoint and the same ``X-Request-Id``; otherwise D waits silently for its registration
  watchdog (``push_registration_timeout``, default ``decoder_kv_blocks_ttl`` = 480 s).
* D's ``remote_request_id`` must be present: push_scheduler.py:200-201 seeds only
  ``remote_block_ids`` before queueing the request in ``_reqs_need_recv``, and the base
  scheduler's ``build_connector_meta`` (base_scheduler.py:488) calls metadata.py
  ``add_new_req_to_recv``, which indexes ``kv_transfer_params["remote_request_id"]`` without a
  default (metadata.py:334): a missing key is a KeyError that kills D's EngineCore. P's id
  (``cmpl-{X-Request-Id}-0-{rand8}``) is unknown up front, so we send ``None``. On D it only
  ends up in ``RemoteMeta.request_id``, which push mode only logs (base_worker.py:1241; the
  PUSH_REG carries D's own request id and P's completion notification names D's request), and
  ``None`` makes D skip heartbeats (base_scheduler.py:214-222), which could not name P's
  request anyway.

Also: ``GET /v1/models`` (first D's), ``GET /health`` (backends, outstanding counts;
``?probe=1`` checks each backend's ``/health``, 503 if one fails), ``GET /metrics`` (prefix
``kv_push_router_``, private registry per app).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest

from kv_push.common.auth import TransferParamsSigner
from kv_push.common.router_config import Backend, BackendPool, RouterConfig, parse_args

logger = logging.getLogger("kv_push.router")

# The P leg's kv_transfer_params in pull mode, as vLLM's example proxy sends them.
PULL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """The router's Prometheus metrics, in a private registry (tests build several apps)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p, lat = "kv_push_router_", ["endpoint", "mode"]
        self.requests = Counter(p + "requests", "Client requests by outcome",
                                ["endpoint", "mode", "outcome"], registry=r)
        self.upstream_errors = Counter(p + "upstream_errors", "Failed upstream legs",
                                       ["leg", "kind"], registry=r)
        self.late_prefill_failures = Counter(
            p + "late_prefill_failures", "P legs that failed after D had produced output",
            registry=r)
        self.outstanding = Gauge(p + "outstanding_requests", "In-flight legs per backend",
                                 ["role", "backend"], registry=r)
        self.ttfb = Histogram(p + "decode_ttfb_seconds", "Router receipt to first byte from D",
                              lat, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_latency_seconds", "Router receipt to end of response",
                             lat, buckets=_LATENCY_BUCKETS, registry=r)


def _error_response(status: int, message: str, kind: str, tid: str | None = None
                    ) -> JSONResponse:
    """An OpenAI-style error: ``{"error": {"message", "type", "code"}}``."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status, headers={"X-Request-Id": tid} if tid else None)


class UpstreamError(Exception):
    """A failed leg, carrying what the client should get."""

    def __init__(self, leg: str, kind: str, status: int, message: str) -> None:
        super().__init__(message)
        self.leg, self.kind, self.status, self.message = leg, kind, status, message

    def to_response(self, tid: str | None) -> JSONResponse:
        return _error_response(self.status, self.message, f"{self.leg}_error", tid)


class ClientGone(Exception):
    """The client disconnected before the response started."""


def _upstream_message(resp: httpx.Response) -> str:
    """The error message in an upstream error body (OpenAI or vLLM style), else the raw text."""
    try:
        data = resp.json()
        err = data.get("error", data)
        return str((err.get("message") if isinstance(err, dict) else err) or data)
    except (ValueError, AttributeError):
        return resp.text[:500]


async def _wait_disconnect(receive: Any) -> None:
    """Return once the ASGI server reports ``http.disconnect`` (after the request body)."""
    while (await receive())["type"] != "http.disconnect":
        pass


@dataclass
class DecodeStream:
    """An open D response: the first bytes (whole body when not streaming) and the rest."""

    resp: httpx.Response
    first: bytes
    rest: AsyncIterator[bytes] | None

    async def aclose(self) -> None:
        if self.rest is not None:
            await self.rest.aclose()  # type: ignore[attr-defined]
        await self.resp.aclose()  # mid-body, this closes the connection: vLLM aborts the request


@dataclass(frozen=True)
class PeerInfo:
    """What a D needs to know about an upstream-push P besides its side channel."""

    engine_id: str
    tp_size: int = 1
    pp_size: int = 1


class Exchange:
    """One client request: its backends, transfer id, leg tasks, and clean-up."""

    def __init__(self, router: Router, endpoint: str, body: dict, request: Request) -> None:
        self.router, self.endpoint, self.body = router, endpoint, body
        self.stream = bool(body.get("stream"))
        self.tid = uuid.uuid4().hex
        self.t0 = time.perf_counter()
        self.p = router.prefill_pool.acquire()
        self.d = router.decode_pool.acquire()
        self.p_task: asyncio.Task | None = None
        self.d_task: asyncio.Task | None = None
        self.disconnect = asyncio.ensure_future(_wait_disconnect(request.receive))
        self.outcome = "ok"
        self.labels = {"endpoint": endpoint, "mode": router.config.mode}
        self._closed = False

    async def close(self) -> None:
        """Cancel what must not outlive the response; hand a still-running P to the router."""
        if self._closed:
            return
        self._closed = True
        p, d = self.p_task, self.d_task
        adopted = p is not None and not p.done() and self.outcome == "ok"
        if adopted:
            self.router.adopt(p)  # D is done; let P finish (its leg then releases its slot)
        if p is not None and p.done() and not p.cancelled():
            p.exception()  # mark it retrieved; a failure was counted when it happened
        if d is not None and d.done() and not d.cancelled() and d.exception() is None:
            await d.result().aclose()
        pending = [t for t in (self.disconnect, d, None if adopted else p)
                   if t is not None and not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self.d.release()
        if not adopted:
            self.p.release()  # the leg's own finally does it too, unless cancelled before start
        self.router.metrics.requests.labels(**self.labels, outcome=self.outcome).inc()
        self.router.metrics.e2e.labels(**self.labels).observe(time.perf_counter() - self.t0)


class ProxyStream(StreamingResponse):
    """Streams D's body to the client while watching for the client going away.

    A custom ``__call__`` (not Starlette's) so that a disconnect is seen at once on every ASGI
    server, even while D is silent, and so that the exchange is always closed afterwards.
    """

    def __init__(self, ex: Exchange, d: DecodeStream) -> None:
        headers = {"X-Request-Id": ex.tid, "Cache-Control": "no-cache"}
        media_type = d.resp.headers.get("content-type", "text/event-stream")
        super().__init__(iter(()), status_code=d.resp.status_code, headers=headers,
                         media_type=media_type)
        self.ex, self.d = ex, d
        self._finished = False

    async def _pump(self, send: Any) -> None:
        ex = self.ex
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        if self.d.first:
            await send({"type": "http.response.body", "body": self.d.first, "more_body": True})
        try:
            async for chunk in self.d.rest or ():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:  # too late for an error status: end the stream
            ex.outcome = "decode_error"
            ex.router.failure(ex, "decode", ex.d.backend.url, exc)
        self._finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        ex = self.ex
        pump = asyncio.ensure_future(self._pump(send))
        try:
            await asyncio.wait({pump, ex.disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if not pump.done() and not self._finished:
                pump.cancel()  # the server saw the client leave while D was still sending
            (result,) = await asyncio.gather(pump, return_exceptions=True)
            if isinstance(result, asyncio.CancelledError | OSError):
                ex.outcome = "client_disconnect"
                logger.info("tid=%s: client disconnected while streaming", ex.tid)
            elif isinstance(result, BaseException):
                ex.outcome = "router_error"
                raise result
        finally:
            pump.cancel()
            await ex.close()


class Router:
    """Backends, the shared HTTP client, metrics, and the dispatch logic."""

    def __init__(self, config: RouterConfig) -> None:
        self.config, self.metrics = config, Metrics()
        gauge = self.metrics.outstanding.labels
        self.prefill_pool = BackendPool([Backend("prefill", s.url, gauge("prefill", s.url), s)
                                         for s in config.prefill])
        self.decode_pool = BackendPool([Backend("decode", u, gauge("decode", u))
                                        for u in config.decode])
        self.peers: dict[str, PeerInfo] = {  # upstream-push: what D must know about each P
            s.url: PeerInfo(s.engine_id, s.tp_size, s.pp_size)
            for s in config.prefill if s.engine_id}
        self.client: httpx.AsyncClient | None = None
        self._background: set[asyncio.Task] = set()
        # push mode: signs both legs' kv_transfer_params with KV_PUSH_SECRET (or the file named
        # by KV_PUSH_SECRET_FILE); P and D with the secret act on signed params only
        self.signer = TransferParamsSigner.from_env()
        if config.mode == "push" and not self.signer.enabled:
            logger.warning("no KV_PUSH_SECRET: kv_transfer_params go out unsigned (P and D with "
                           "a secret will serve such requests without KV transfer)")

    async def start(self) -> None:
        c = self.config
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(c.timeout, connect=c.connect_timeout),
            limits=httpx.Limits(max_connections=c.max_connections,
                                max_keepalive_connections=min(256, c.max_connections)),
        )

    async def stop(self) -> None:
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()

    # -- bookkeeping ---------------------------------------------------------------------------

    def failure(self, ex: Exchange | None, leg: str, url: str, exc: Exception | httpx.Response
               ) -> UpstreamError:
        """Classify a failure, count and log it once, and build the client's error."""
        if isinstance(exc, httpx.Response):
            kind, status = f"http_{exc.status_code // 100}xx", exc.status_code
            msg = f"{leg} backend {url} returned HTTP {status}: {_upstream_message(exc)}"
        elif isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            kind, status, msg = "timeout", 504, f"{leg} backend {url} timed out: {exc!r}"
        elif isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            kind, status, msg = "connect", 502, f"cannot connect to {leg} backend {url}: {exc!r}"
        elif isinstance(exc, ValueError):
            kind, status, msg = "bad_response", 502, f"{leg} backend {url} sent bad JSON: {exc}"
        else:
            kind, status, msg = "transport", 502, f"{leg} backend {url} failed: {exc!r}"
        self.metrics.upstream_errors.labels(leg=leg, kind=kind).inc()
        logger.warning("tid=%s %s leg failed (%s): %s", ex.tid if ex else "-", leg, kind, msg)
        return UpstreamError(leg, kind, status, msg)

    def adopt(self, task: asyncio.Task) -> None:
        """Keep a P leg that outlives its exchange until it ends (cancelled at shutdown)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _note_late_prefill(self, task: asyncio.Task) -> None:
        """Done-callback for a P leg still running when D produced output."""
        if not task.cancelled() and task.exception() is not None:
            self.metrics.late_prefill_failures.inc()

    # -- legs ----------------------------------------------------------------------------------

    async def _prefill_leg(self, ex: Exchange, body: dict, headers: dict) -> dict:
        """POST the P leg; return its JSON. Releases P's slot when it ends, however it ends."""
        assert self.client is not None
        url = ex.p.backend.url
        try:
            try:
                resp = await self.client.post(url + ex.endpoint, json=body, headers=headers)
                if resp.status_code >= 400:
                    raise self.failure(ex, "prefill", url, resp)
                data = resp.json()
                if not isinstance(data, dict):
                    raise ValueError("response is not a JSON object")
            except (httpx.HTTPError, ValueError) as exc:
                raise self.failure(ex, "prefill", url, exc) from None
            if self.config.mode == "upstream-push":
                self._learn_peer(url, data.get("kv_transfer_params"))
            return data
        finally:
            ex.p.release()

    async def _open_decode(self, ex: Exchange, body: dict, headers: dict) -> DecodeStream:
        """Send the D leg and wait for its first bytes (its whole body when not streaming)."""
        assert self.client is not None
        url = ex.d.backend.url
        req = self.client.build_request("POST", url + ex.endpoint, json=body, headers=headers)
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise self.failure(ex, "decode", url, exc) from None
        try:
            if resp.status_code >= 400:
                await resp.aread()
                raise self.failure(ex, "decode", url, resp)
            rest: AsyncIterator[bytes] | None = None
            if ex.stream:
                rest = resp.aiter_bytes()
                first = b""
                async for first in rest:
                    if first:
                        break
            else:
                first = await resp.aread()
            self.metrics.ttfb.labels(**ex.labels).observe(time.perf_counter() - ex.t0)
            return DecodeStream(resp, first, rest)
        except BaseException as exc:
            await resp.aclose()
            if isinstance(exc, httpx.HTTPError):
                raise self.failure(ex, "decode", url, exc) from None
            raise

    def _learn_peer(self, url: str, params: Any) -> None:
        """Remember (or refresh) an upstream-push P's engine id and sizes from its response."""
        if not isinstance(params, dict) or not params.get("remote_engine_id"):
            logger.warning("prefill %s returned no kv_transfer_params.remote_engine_id", url)
            return
        if params.get("transfer_mode", "push") != "push":
            logger.warning("prefill %s reports transfer_mode=%r, expected 'push'",
                           url, params.get("transfer_mode"))
        peer = PeerInfo(str(params["remote_engine_id"]), int(params.get("tp_size") or 1),
                        int(params.get("pp_size") or 1))
        if (old := self.peers.get(url)) != peer:
            logger.info("prefill %s: learned %s (was %s)", url, peer, old)
            self.peers[url] = peer

    # -- dispatch ------------------------------------------------------------------------------

    def _prefill_body(self, ex: Exchange) -> dict:
        """The P leg's body: one token, not streamed, with the mode's ``kv_transfer_params``."""
        body = dict(ex.body, max_tokens=1, stream=False)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        for key in ("stream_options", "min_tokens"):  # min_tokens > 1 would make vLLM reject it
            body.pop(key, None)
        body["kv_transfer_params"] = (
            self.signer.sign({"transfer_id": ex.tid, "do_remote_decode": True})
            if self.config.mode == "push" else dict(PULL_PREFILL_PARAMS))
        return body

    def _decode_params(self, ex: Exchange) -> dict | None:
        """D's ``kv_transfer_params`` for the concurrent modes; ``None`` means "ask P first"."""
        spec = ex.p.backend.spec
        assert spec is not None
        if self.config.mode == "push":
            return self.signer.sign({"transfer_id": ex.tid, "do_remote_prefill": True,
                                     "remote_host": spec.kv_host, "remote_port": spec.kv_port})
        if self.config.mode == "upstream-push" and (peer := self.peers.get(spec.url)):
            # remote_request_id: present (metadata.py indexes it) but None (P's id is unknown).
            return {"do_remote_prefill": True, "do_remote_decode": False,
                    "remote_engine_id": peer.engine_id, "remote_request_id": None,
                    "remote_host": spec.kv_host, "remote_port": spec.kv_port,
                    "tp_size": peer.tp_size, "pp_size": peer.pp_size}
        return None

    async def _await(self, ex: Exchange, task: asyncio.Task) -> Any:
        """Wait for one leg; raise :class:`ClientGone` if the client leaves first."""
        await asyncio.wait({task, ex.disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if ex.disconnect.done():
            raise ClientGone
        return task.result()

    async def dispatch(self, ex: Exchange, request: Request) -> DecodeStream:
        """Run the legs until D has produced output; raise UpstreamError / ClientGone."""
        headers = {"X-Request-Id": ex.tid}
        if auth := request.headers.get("authorization"):
            headers["Authorization"] = auth
        ex.p_task = asyncio.ensure_future(self._prefill_leg(ex, self._prefill_body(ex), headers))
        d_params = self._decode_params(ex)
        if d_params is None:  # serial: pull, or upstream-push before P's engine id is known
            p_json = await self._await(ex, ex.p_task)
            # upstream-push: P's reply taught us its engine id (_prefill_leg); D gets the same
            # params as a concurrent leg, not P's verbatim (see the module docstring).
            d_params = self._decode_params(ex) or p_json.get("kv_transfer_params")
            if not d_params:
                logger.warning("tid=%s: P returned no kv_transfer_params; D will recompute",
                               ex.tid)
            d_body = dict(ex.body, kv_transfer_params=d_params) if d_params else ex.body
            ex.d_task = asyncio.ensure_future(self._open_decode(ex, d_body, headers))
            return await self._await(ex, ex.d_task)

        d_body = dict(ex.body, kv_transfer_params=d_params)
        ex.d_task = asyncio.ensure_future(self._open_decode(ex, d_body, headers))
        waiting: set[asyncio.Future] = {ex.p_task, ex.d_task, ex.disconnect}
        while True:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if ex.disconnect in done:
                raise ClientGone
            if ex.d_task in done:
                stream = ex.d_task.result()  # a D failure raises here; close() cancels P
                if ex.p_task.done():
                    self._note_late_prefill(ex.p_task)
                else:
                    ex.p_task.add_done_callback(self._note_late_prefill)
                return stream
            ex.p_task.result()  # a P failure before D's output raises here; close() cancels D
            waiting.discard(ex.p_task)

    async def handle(self, request: Request, endpoint: str) -> Response:
        """Serve one completions / chat completions request."""
        labels = {"endpoint": endpoint, "mode": self.config.mode}
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
        except ValueError as exc:
            self.metrics.requests.labels(**labels, outcome="bad_request").inc()
            return _error_response(400, f"invalid JSON body: {exc}", "invalid_request_error")
        ex = Exchange(self, endpoint, body, request)
        handed_off = False
        try:
            d = await self.dispatch(ex, request)
            if ex.stream:
                response, handed_off = ProxyStream(ex, d), True  # it closes the exchange
                return response
            return Response(d.first, status_code=d.resp.status_code,
                            media_type=d.resp.headers.get("content-type", "application/json"),
                            headers={"X-Request-Id": ex.tid})
        except UpstreamError as err:
            ex.outcome = f"{err.leg}_error"
            return err.to_response(ex.tid)
        except ClientGone:
            ex.outcome = "client_disconnect"
            logger.info("tid=%s: client disconnected before the response started", ex.tid)
            return Response(status_code=499)
        except BaseException:
            ex.outcome = "router_error"
            raise
        finally:
            if not handed_off:
                await ex.close()

    async def health(self, probe: bool) -> JSONResponse:
        """Backends and their outstanding legs; with ``probe`` also each one's ``/health``."""
        async def check(url: str) -> str | None:  # None: healthy, else the problem
            assert self.client is not None
            try:
                r = await self.client.get(url + "/health", timeout=self.config.health_probe_timeout)
                return None if r.status_code == 200 else f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                return repr(exc)

        backends = self.prefill_pool.backends + self.decode_pool.backends
        problems = await asyncio.gather(*(check(b.url) for b in backends)) if probe else []
        info: dict[str, Any] = {"status": "degraded" if any(problems) else "ok",
                                "mode": self.config.mode, "prefill": [], "decode": []}
        for i, b in enumerate(backends):
            entry: dict[str, Any] = {"url": b.url, "outstanding": b.outstanding}
            if b.spec is not None:
                entry["kv"] = b.spec.kv
            if probe:
                entry.update(healthy=problems[i] is None, error=problems[i])
            info[b.role].append(entry)
        return JSONResponse(info, status_code=503 if any(problems) else 200)

    async def models(self) -> Response:
        """``GET /v1/models`` of the first decode server."""
        assert self.client is not None
        url = self.decode_pool.backends[0].url
        try:
            r = await self.client.get(url + "/v1/models")
        except httpx.HTTPError as exc:
            return self.failure(None, "decode", url, exc).to_response(None)
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))


def build_app(config: RouterConfig) -> FastAPI:
    """The router as a FastAPI app (``app.state.router`` is the :class:`Router`)."""
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="kv-push-router", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.models()

    @app.get("/health")
    async def health(probe: bool = False) -> Response:
        return await router.health(probe)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``kv-push-router``."""
    config, log_level = parse_args(argv)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("mode=%s prefill=%s decode=%s", config.mode,
                [f"{p.url} (kv {p.kv})" for p in config.prefill], list(config.decode))
    uvicorn.run(build_app(config), host=config.host, port=config.port, log_level=log_level)


if __name__ == "__main__":
    main()
