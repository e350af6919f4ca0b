"""The router's HTTP side: the FastAPI app, the dispatch of each request's two legs, and the
streaming of D's response to the client.

Per ``POST /v1/completions`` / ``/v1/chat/completions`` one P and one D are picked
(:class:`~kv_push.common.router.pool.BackendPool`), a transfer id is made (also both legs'
``X-Request-Id`` unless the client sent one) and the legs are sent per ``--mode``: ``push`` (this project's connector) and
``upstream-push`` (vLLM's ``NixlPushConnector``, once P's engine id is known) at the same time,
``pull`` (vLLM's ``NixlConnector``) P first. The P leg asks for one token, not streamed; D's
response is the client's. A P failure before D's first byte cancels D and becomes the client's
error (OpenAI-style body; 502 connect, 504 timeout, else the upstream status); a D failure cancels
P; a P failure after D's first byte is only counted. A client that goes away cancels both legs.
When a D leg fails because D refused that P at the KV handshake (``compat``: read from D's
``/metrics``), the client's error says so and why (type ``incompatible_peers``), and ``/health``
lists the pair.

In push mode an exchange that ends without D's output (client gone before D's first byte, D
failed, P failed) also releases P's prefill of it: :mod:`kv_push.common.router.release` sends P a
``Release`` of the transfer id in the background (never delaying the client's response), so P
frees that KV at once rather than at its ``rendezvous_ttl_s``.

With ``KV_PUSH_SECRET`` (or ``KV_PUSH_SECRET_FILE``) in the router's environment, the push
mode signs both legs' ``kv_transfer_params`` (``kv_push_sig``, :mod:`kv_push.common.auth`) and
authenticates its releases with the same key.
What each mode sends and why (with the vLLM source it was read from): ``docs/router.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest

from kv_push.common import timing
from kv_push.common.auth import SecretError, TransferParamsSigner
from kv_push.common.metrics import LogLimiter
from kv_push.common.router import limits
from kv_push.common.router.body_json import read_body, write_body
from kv_push.common.router.builds import Build, BuildBook, read_build
from kv_push.common.router.compat import PairCompat, parse_refusals, without_addresses
from kv_push.common.router.config import RouterConfig, kv_mismatch, parse_args
from kv_push.common.router.first_token import (
    DecodeFilter, FirstTokenMismatch, PrefillAnswerHead, first_token_events, ineligible,
)
from kv_push.common.router.pool import Backend, BackendPool, Lease
from kv_push.common.router.release import ReleaseSender
from kv_push.common.router.sse import StreamHead
from kv_push.common.side_channel import probe as probe_side_channel

logger = logging.getLogger("kv_push.router")

#: the most decoder requests one prefill may serve: the connector's ``MAX_FANOUT`` (pinned by
#: test_router; the router imports nothing from the connector core)
MAX_FANOUT = 1024

# The P leg's kv_transfer_params in pull mode, as vLLM's example proxy sends them.
PULL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
#: (push, upstream-push) after P rejected a request with a 4xx, how long D may take to answer
#: before P's error is the client's: a request both reject gets D's error, as a single server
#: would answer (D has the client's body; P's has max_tokens=1, n=1, no stream)
DECODE_ANSWER_GRACE_S = 1.0
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
        self.ttfb = Histogram(p + "decode_ttfb_seconds",
                              "Router receipt to D's first output (streams: its first event "
                              "past a chat role chunk; else its whole answer)",
                              lat, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_latency_seconds", "Router receipt to end of response",
                             lat, buckets=_LATENCY_BUCKETS, registry=r)
        self.releases = Counter(
            p + "releases", "Transfer ids of exchanges that ended without decode output, by "
            "what became of their release to P (sent, failed, dropped)", ["result"], registry=r)
        self.first_token = Counter(
            p + "first_token", "Streaming push requests by where the client's first token came "
            "from (path: prefill, decode, mismatch) and why (reason; path decode: why not from P, "
            "path prefill: empty_text, partial_character or none)",
            ["path", "reason"], registry=r)
        # the mismatch series exists from the start: "0 mismatches" is readable, not absent
        self.first_token.labels(path="mismatch", reason="")
        self.first_token_seconds = Histogram(
            p + "first_token_seconds", "Streaming requests: router receipt to the first token "
            "sent to the client, by its source (prefill, decode)", ["endpoint", "mode", "source"],
            buckets=_LATENCY_BUCKETS, registry=r)
        self.ejections = Counter(
            p + "backend_ejections", "Backends taken out of selection for a while because a "
            "connection to them could not be made (once per back-off: a backend tried while "
            "already out, as when every backend of a role is down, is not counted again)",
            ["role"], registry=r)
        self.leg_retries = Counter(
            p + "leg_retries", "Legs sent again to another server of their role after the "
            "first could not be connected to (nothing had been sent), by leg (decode; prefill: "
            "before D's leg went out)", ["leg"], registry=r)
        self.release_errors = Counter(
            p + "release_errors", "Releases that did not reach a P rank, by kind (connect, "
            "timeout, refused, bad_reply, internal)", ["kind"], registry=r)
        self.decode_alone = Counter(
            p + "decode_alone", "Requests sent to a decode server alone, with no P leg and no "
            "KV transfer, by reason (beam_search: vLLM runs beam search as requests of its own, "
            "which take no kv_transfer_params; prompt_logprobs: vLLM computes the prompt of such "
            "a request itself)", ["reason"], registry=r)
        self.prefill_rejected_alone = Counter(
            p + "prefill_rejected_alone", "Requests a prefill server rejected (4xx) while the "
            "decode server had not within the grace: the client got P's error (P and D started "
            "with different limits?)", ["backend"], registry=r)
        self.prefill_not_held = Counter(
            p + "prefill_not_held", "push: P answers that did not hold the prefill for a KV "
            "transfer (no kv_transfer_params.transfer_id): D computed the prompt itself",
            ["backend"], registry=r)
        self.kv_mismatch = Counter(
            p + "kv_mismatch", "push: P answers naming a side channel other than the kv= "
            "configured for that P (D registers its transfers elsewhere: they never pair)",
            ["backend"], registry=r)


def _error_response(status: int, message: str, kind: str, tid: str | None = None
                    ) -> JSONResponse:
    """An OpenAI-style error: ``{"error": {"message", "type", "code"}}``."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status, headers={"X-Request-Id": tid} if tid else None)


#: what vLLM's request models (pydantic, lax mode) read as a boolean ``stream`` from a string
_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})


def lax_true(v: Any) -> bool:
    """Whether vLLM reads a request's boolean field as true (a JSON boolean, 0/1, or a string
    such as "false" or "yes"). A value vLLM rejects counts as false: the backend's 400 then
    reaches the client as an ordinary error."""
    if isinstance(v, str):
        return v.lower() in _TRUE_STRINGS
    return v is True or (type(v) in (int, float) and v == 1)


def wants_prompt_logprobs(body: dict, chat: bool) -> bool:
    """Whether vLLM computes the prompt's logprobs for this request: ``prompt_logprobs``, or
    ``echo`` with a completion's ``logprobs`` -- or any chat ``echo``: chat's ``top_logprobs``
    defaults to 0, not None, in vLLM 0.29 and 0.32, so an echo alone asks for them (an explicit
    ``top_logprobs: null`` on 0.29 does not; such a request goes to D alone anyway). vLLM 0.32
    reads no KV it did not compute for such a request (``skip_reading_prefix_cache`` refuses a
    connector's KV too), so P's prefill would be thrown away; vLLM 0.29's scheduler still
    takes the connector's KV for it, and D's prompt logprobs would then miss the tokens it
    did not compute."""
    if body.get("prompt_logprobs") is not None:
        return True
    if not lax_true(body.get("echo")):
        return False
    return chat or body.get("logprobs") is not None


def wants_stream(body: dict) -> bool:
    """Whether the backends will stream this request (``lax_true``)."""
    return lax_true(body.get("stream"))


class UpstreamError(Exception):
    """A failed leg, carrying what the client should get (``error_type``: the body's ``type``,
    ``<leg>_error`` unless given). ``message`` names no backend (those go to the log only);
    ``body``: the backend's own OpenAI-style error body, sent to the client as it is."""

    def __init__(self, leg: str, kind: str, status: int, message: str,
                 error_type: str | None = None, body: dict | None = None) -> None:
        super().__init__(message)
        self.leg, self.kind, self.status, self.message = leg, kind, status, message
        self.error_type = error_type or f"{leg}_error"
        self.body = body

    @property
    def rejected(self) -> bool:
        """The backend answered the request with a 4xx (an unknown model, a prompt too long...):
        the client's mistake as a rule, not the backend's failure."""
        return self.kind == "http_4xx"

    def to_response(self, tid: str | None) -> JSONResponse:
        if self.body is not None:  # as vLLM wrote it: message, type, param, code
            return JSONResponse(self.body, status_code=self.status,
                                headers={"X-Request-Id": tid} if tid else None)
        return _error_response(self.status, self.message, self.error_type, tid)


class ClientGone(Exception):
    """The client disconnected before the response started."""


class EmptyStream(Exception):
    """D's stream ended before any output: vLLM 0.29 drops a failed request's error from its
    stream (the error chunk carries no token, and empty chunks are skipped), leaving only
    ``data: [DONE]``."""


class LegResponse:
    """A leg's response from the aiohttp session (``Router.legs``), with what the router reads
    of it. The legs go through aiohttp, not httpx: on this project's 2-core box httpx's
    per-request machinery (anyio cancel scopes, its pool's locks) took about three times
    aiohttp's time per pair of legs, on the TTFT critical path
    (``benchmarks/bench_router_overhead.py``, ``benchmarks/results/router_overhead.json``)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status_code = resp.status
        self.headers = resp.headers
        self.content = b""
        self.strict = True  # the body read by json() was strict JSON (body_json)

    async def aread(self) -> bytes:
        self.content = await self._resp.read()
        return self.content

    def json(self) -> Any:
        value, self.strict = read_body(self.content)
        return value

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        async for chunk in self._resp.content.iter_any():
            yield chunk

    async def read_head(self, head: StreamHead) -> bytes:
        """Feed the body to ``head`` as it comes until its kind is known or the body ends;
        returns what was read (``head.data``; the rest, if any, is for :meth:`aread`)."""
        while True:
            chunk = await self._resp.content.readany()
            if not chunk or head.feed(chunk) is not None:
                return head.data

    @property
    def at_eof(self) -> bool:
        return self._resp.content.at_eof()

    async def aclose(self) -> None:
        """Give the connection back when the body was read to its end; mid-body, close it (vLLM
        then aborts the request)."""
        if self.at_eof:
            self._resp.release()
        else:
            self._resp.close()


def leg_proxy(url: str) -> str | None:
    """The proxy the environment names for the backend ``url``, or None: ``http_proxy`` /
    ``https_proxy`` (lower case first) by the backend's scheme, unless ``no_proxy`` names its
    host -- urllib's rules, which aiohttp's ``trust_env`` also applies (host names and domain
    suffixes, ``*``; no CIDR ranges). A value without a scheme is taken as ``http://``, as curl
    and httpx take it. Raises ValueError for a proxy the legs cannot use (aiohttp speaks to
    HTTP and HTTPS proxies only, not SOCKS)."""
    parts = urlsplit(url)
    if parts.hostname is None or urllib.request.proxy_bypass(parts.hostname):
        return None
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy:
        return None
    if "://" not in proxy:
        proxy = "http://" + proxy
    p = urlsplit(proxy)
    if p.scheme not in ("http", "https") or not p.hostname:
        raise ValueError(f"the {parts.scheme}_proxy variable names {redacted(proxy)!r}, which "
                         f"the router's legs to {url} cannot use (HTTP and HTTPS proxies only; "
                         "no_proxy can exempt the backend)")
    return proxy


def redacted(url: str) -> str:
    """``url`` without a user name and password."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


#: the longest client X-Request-Id the legs carry (a longer one is replaced by the transfer id)
MAX_REQUEST_ID = 256
#: what a leg's transport raises when it cannot connect at all (nothing was sent)
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
#: what a leg's transport raises (aiohttp's timeouts are ``asyncio.TimeoutError``\ s too: the
#: built-in ``TimeoutError`` from Python 3.11, a class of its own on 3.10)
LEG_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def _upstream_message(resp: LegResponse) -> tuple[str, dict | None]:
    """The error message in an upstream error body, else the raw text; and the body itself when
    it is an OpenAI-style error (``{"error": {"message", "type", ...}}``, or vLLM's older flat
    ``{"object": "error", "message", "type", "param", "code"}``)."""
    try:
        data = resp.json()
        err = data.get("error", data)
        message = str((err.get("message") if isinstance(err, dict) else err) or data)
    except (ValueError, AttributeError):
        return resp.text[:500], None
    openai = isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err
    return message, data if openai else None


def _as_received(header: str) -> str:
    """A header value as the legs' client (aiohttp, which encodes UTF-8) must be given it to
    send the bytes the client sent: the server (Starlette) decoded them as Latin-1, so a UTF-8
    ``ü`` came in as ``Ã¼``, and vLLM, reading the leg's bytes as Latin-1 too, then names the
    response as a single server would. Only bytes that are valid UTF-8 are kept so; others
    (a raw Latin-1 ``ü``) reach the legs UTF-8-encoded, as before."""
    try:
        return header.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return header


async def _on_headers_sent(session: aiohttp.ClientSession, ctx: Any, params: Any) -> None:
    """aiohttp trace hook: a leg's request headers are written, so its connection was made. A
    leg that passes a future as ``trace_request_ctx`` (the P leg in the concurrent modes:
    ``Router.dispatch``) learns it here, before any answer."""
    sent = ctx.trace_request_ctx
    if isinstance(sent, asyncio.Future) and not sent.done():
        sent.set_result(None)


def _leg_traces() -> list[aiohttp.TraceConfig]:
    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(_on_headers_sent)
    return [trace]


def _acquire_up(pool: BackendPool, tried: set[str], avoid: Collection[str] = ()
                ) -> Lease | None:
    """A slot on a backend of ``pool`` that is up and not in ``tried`` (a leg moving on after
    a connection failure: never to one left out of selection), preferring those not in
    ``avoid``; None when there is none."""
    now = time.monotonic()
    down = {b.url for b in pool.backends if not b.up(now)}
    return pool.acquire(avoid=avoid, exclude=tried | down)


async def _wait_disconnect(receive: Any) -> None:
    """Return once the ASGI server reports ``http.disconnect`` (after the request body)."""
    while (await receive())["type"] != "http.disconnect":
        pass


@dataclass
class DecodeStream:
    """An open D response: the first bytes (whole body when not streaming) and the rest."""

    resp: LegResponse
    first: bytes
    rest: AsyncIterator[bytes] | None
    output: bool = True  # D produced output (False: an error status or event came first)
    refused: bool = False  # that error event said 4xx: D refused the client's request

    @property
    def status_code(self) -> int:
        return self.resp.status_code

    @property
    def media_type(self) -> str:
        return self.resp.headers.get("content-type", "text/event-stream")

    async def aclose(self) -> None:
        if self.rest is not None:
            await self.rest.aclose()  # type: ignore[attr-defined]
        await self.resp.aclose()  # mid-body, this closes the connection: vLLM aborts the request


class PrefillFirstStream:
    """A streaming response that starts with P's first token (``first``: its SSE events) and
    goes on with D's stream without D's copy of that token (``first_token.py``). D's leg is
    still ``ex.d_task``; it is awaited when the client has had the first token."""

    status_code = 200
    media_type = "text/event-stream"
    output = True

    def __init__(self, ex: "Exchange", first: bytes, text: str, chat: bool) -> None:
        self.ex, self.first, self._text, self._chat = ex, first, text, chat
        self.rest = self._rest()

    async def _rest(self) -> AsyncIterator[bytes]:
        ex = self.ex
        router = ex.router
        assert ex.d_task is not None
        try:
            d = await ex.d_task
        except UpstreamError as err:  # D failed before any output: end the stream with it
            ex.outcome = "decode_error"
            yield _error_event(err.message, err.error_type, err.status, b"")
            return
        router.decode_answered(ex, d)
        filt = DecodeFilter(self._text, self._chat)
        try:
            out = filt.feed(d.first)
            if out:
                yield out
            async for data in d.rest or ():
                out = filt.feed(data)
                if out:
                    yield out
        except FirstTokenMismatch as e:
            ex.outcome = "first_token_mismatch"
            router.metrics.first_token.labels(path="mismatch", reason="").inc()
            if "\ufffd" in self._text and ex.build_checked is not None:  # taken from P on
                # the pair's build: not again on it
                router.builds.distrust(ex.p.backend.url, ex.d.backend.url, ex.build_checked)
            logger.error("tid=%s: %s; the stream is ended with an error", ex.tid, e)
            yield _error_event(f"{e}: the response was cut after the first token "
                               "(--first-token-from-prefill off avoids this)",
                               "first_token_mismatch", 500, b"")

    async def aclose(self) -> None:
        await self.rest.aclose()  # type: ignore[attr-defined]


def _error_event(message: str, kind: str, status: int, lead: bytes) -> bytes:
    event = json.dumps({"error": {"message": message, "type": kind, "code": status}})
    return lead + f"data: {event}\n\ndata: [DONE]\n\n".encode()


@dataclass(frozen=True)
class PeerInfo:
    """What a D needs to know about an upstream-push P besides its side channel."""

    engine_id: str
    tp_size: int = 1
    pp_size: int = 1


class Exchange:
    """One client request: its backends, transfer id, leg tasks, and clean-up."""

    def __init__(self, router: Router, endpoint: str, body: dict, request: Request,
                 strict_json: bool = True) -> None:
        self.router, self.endpoint, self.body = router, endpoint, body
        #: the client's body was strict JSON: the legs' bodies are written by msgspec
        #: (``body_json``), else as Python's json module writes them
        self.strict_json = strict_json
        self.stream = wants_stream(body)
        self.tid = uuid.uuid4().hex
        # the client's X-Request-Id, as one vLLM server takes it: its legs carry it (vLLM names
        # the response after it) and the response repeats it; the transfer id stays ours
        # (unique). upstream-push pairs the legs by X-Request-Id, so there they carry the tid.
        client_id = request.headers.get("x-request-id", "")
        self.request_id = client_id if 0 < len(client_id) <= MAX_REQUEST_ID else self.tid
        self.leg_request_id = self.tid if router.config.mode == "upstream-push" \
            else _as_received(self.request_id)
        if self.request_id != self.tid:
            logger.debug("tid=%s: the client's X-Request-Id is %r", self.tid, client_id)
        self.t0 = time.perf_counter()
        p = router.prefill_pool.acquire()
        assert p is not None
        # a decode server known not to work with that P is passed over while another is up
        d = router.decode_pool.acquire(avoid=router.compat.avoided(p.backend.url))
        assert d is not None
        self.p, self.d = p, d
        self.p_task: asyncio.Task | None = None
        self.d_task: asyncio.Task | None = None
        self.disconnect = asyncio.ensure_future(_wait_disconnect(request.receive))
        self.outcome = "ok"
        self.labels = {"endpoint": endpoint, "mode": router.config.mode}
        self.decode_output = False  # D produced output: its engine saw the request and has it
        #: why the client's first token does not come from P (None: it may; first_token.py)
        self.first_token_off = router.first_token_off(endpoint, body)
        self._closed = False
        self.p_unsent = False  # P's leg could not be connected (so P holds nothing of it)
        self.alone = ""  # why D got it alone, with no P leg and no KV (Router._decode_alone)
        #: (first token from P) the build P and the decoders were read as when P answered
        #: (Router.common_build; None: not one), which a mismatch then distrusts
        self.build_checked: Build | None = None
        if timing.ENABLED:
            timing.stamp("router_in", self.tid, endpoint=endpoint)

    def encode(self, body: dict) -> bytes:
        """A leg's body as JSON bytes: msgspec where everything in it was strict JSON (the
        client's body, and P's answer that D's body may carry), else Python's json."""
        return write_body(body, self.strict_json)

    async def close(self) -> None:
        """Cancel what must not outlive the response; hand a still-running P to the router."""
        if self._closed:
            return
        self._closed = True
        if timing.ENABLED:
            timing.stamp("router_out", self.tid, outcome=self.outcome)
        if not self.decode_output:
            self.router.release(self)  # queued only: the response is not delayed
        p, d = self.p_task, self.d_task
        adopted = p is not None and not p.done() and self.outcome == "ok"
        if adopted:
            self.router.adopt(p)  # D is done; let P finish (its leg then releases its slot)
        if p is not None and p.done() and not p.cancelled():
            p.exception()  # mark it retrieved; a failure was counted when it happened
        pending = [t for t in (self.disconnect, d, None if adopted else p)
                   if t is not None and not t.done()]
        for t in pending:
            t.cancel()
        try:
            if d is not None and d.done() and not d.cancelled() and d.exception() is None:
                await d.result().aclose()
            await asyncio.gather(*pending, return_exceptions=True)
        finally:  # however the awaits end (this task cancelled meanwhile): never a slot kept
            self.d.release()
            if not adopted:
                self.p.release()  # the leg's own finally does it too, unless cancelled early
            self.router.metrics.requests.labels(**self.labels, outcome=self.outcome).inc()
            self.router.metrics.e2e.labels(**self.labels).observe(time.perf_counter() - self.t0)


class ProxyStream(StreamingResponse):
    """Streams D's body to the client while watching for the client going away.

    A custom ``__call__`` (not Starlette's) so that a disconnect is seen at once on every ASGI
    server, even while D is silent, and so that the exchange is always closed afterwards.
    """

    def __init__(self, ex: Exchange, d: DecodeStream | PrefillFirstStream) -> None:
        headers = {"X-Request-Id": ex.request_id, "Cache-Control": "no-cache"}
        super().__init__(iter(()), status_code=d.status_code, headers=headers,
                         media_type=d.media_type)
        self.ex, self.d = ex, d
        self._finished = False
        self._complete = False  # the last bytes sent were the stream's final [DONE]

    async def _pump(self, send: Any) -> None:
        ex = self.ex
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        tail = b""
        if self.d.first:
            await send({"type": "http.response.body", "body": self.d.first, "more_body": True})
            tail = self._seen(tail, self.d.first)
        try:
            async for chunk in self.d.rest or ():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                tail = self._seen(tail, chunk)
        except LEG_ERRORS as exc:  # too late for an error status: say so in the stream
            if self._complete:  # D's final [DONE] was sent: the answer is whole, only the
                # connection's end was lost (D stopped or reset it after the last event)
                logger.info("router: decode server %s: connection lost after the stream's "
                            "end (request %s): %s", ex.d.backend.url, ex.tid, exc)
                self._finished = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            ex.outcome = "decode_error"
            err = ex.router.failure(ex, "decode", ex.d.backend.url, exc)
            if "event-stream" in self.media_type:  # as vLLM reports a failure mid-stream
                event = json.dumps({"error": {"message": err.message, "type": err.error_type,
                                              "code": err.status}})
                end = b"" if tail.endswith(b"\n\n") else b"\n\n"  # close a cut-off event
                await send({"type": "http.response.body", "more_body": True,
                            "body": end + f"data: {event}\n\ndata: [DONE]\n\n".encode()})
        self._finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    #: how an SSE stream's last event ends, and how vLLM reports a failure inside one
    _DONE, _ERROR = b"data: [DONE]\n\n", b'\n\ndata: {"error"'

    def _seen(self, tail: bytes, chunk: bytes) -> bytes:
        """Note what the client has been sent: an error event (vLLM's way to fail a stream after
        its 200: counted as D's error, not as a served request) and the final ``[DONE]`` (a
        client that leaves after it had the whole response). Returns the new tail (enough
        bytes to see either across chunk boundaries)."""
        seen = tail + chunk
        if self._ERROR in b"\n\n" + seen and self.ex.outcome == "ok":
            self.ex.outcome = "decode_error"
        self._complete = seen.endswith(self._DONE)
        return seen[-len(self._ERROR):]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        ex = self.ex
        pump = asyncio.ensure_future(self._pump(send))
        try:
            await asyncio.wait({pump, ex.disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if not pump.done() and not self._finished:
                pump.cancel()  # the server saw the client leave while D was still sending
            (result,) = await asyncio.gather(pump, return_exceptions=True)
            if isinstance(result, asyncio.CancelledError | OSError) and self._complete:
                pass  # the client had the whole stream, [DONE] included, and hung up first
            elif isinstance(result, asyncio.CancelledError | OSError):
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
        self.client: httpx.AsyncClient | None = None  # health probes, /metrics, forward()
        self.legs: aiohttp.ClientSession | None = None  # the P and D legs (LegResponse)
        self._background: set[asyncio.Task] = set()
        #: (P, D, model) pairs started with different max_model_len (limits.py), once read
        self.limit_mismatches: list[dict] = []
        self._limits_task: asyncio.Task | None = None
        self.compat = PairCompat()
        #: (push, first token from P) which vLLM build each backend runs (builds.py)
        self.builds = BuildBook()
        self._read_builds = config.mode == "push" and config.first_token_from_prefill == "auto"
        self._log = LogLimiter(logger)  # warnings that may repeat with every request
        # push mode: signs both legs' kv_transfer_params with KV_PUSH_SECRET (or the file named
        # by KV_PUSH_SECRET_FILE); P and D with the secret act on signed params only
        self.signer = TransferParamsSigner.from_env()
        extra = [p.url for p in config.prefill
                 if p.engine_id is not None or p.tp_size != 1 or p.pp_size != 1]
        if config.mode == "push" and extra:
            logger.warning("--prefill %s: engine_id, tp and pp are for --mode upstream-push; "
                           "ignored in --mode push (P's identity and parallelism come from its "
                           "side channel)", ", ".join(extra))
        if config.mode == "push" and not self.signer.enabled:
            logger.warning("no KV_PUSH_SECRET: kv_transfer_params go out unsigned (P and D with "
                           "a secret will serve such requests without KV transfer)")
        if config.mode == "upstream-push" and self.signer.enabled:
            logger.warning("--mode upstream-push with a secret: the upstream request form "
                           "cannot be signed, so P and D running KVPushConnector with the secret "
                           "serve every request without KV transfer (D computes the prompt; "
                           "they count rejected{unsigned_upstream_transfer_params}); use --mode "
                           "push with a secret, or no secret with this mode")
        # push mode: releases P's prefills of exchanges that end without D's output
        self.releaser = ReleaseSender(self.signer.codec(), config.release_timeout,
                                      self.metrics.releases, self.metrics.release_errors)

    async def start(self) -> None:
        c = self.config
        for b in self.prefill_pool.backends + self.decode_pool.backends:  # (before any client)
            b.proxy = leg_proxy(b.url)
            if b.proxy:
                logger.info("%s %s: legs go through the proxy %s (from the environment)", b.role,
                            b.url, redacted(b.proxy))
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(c.timeout, connect=c.connect_timeout),
            limits=httpx.Limits(max_connections=c.max_connections,
                                max_keepalive_connections=min(256, c.max_connections)),
        )
        # connect: waiting for a free connection of the pool, and connecting (as httpx's pool
        # time-out was `timeout`); sock_read: no bytes for `timeout` seconds. No trust_env:
        # with it aiohttp reads ~/.netrc and the proxy variables again for every leg, each in a
        # worker thread: two thread hops per leg on the TTFT path (bench_router_overhead.py's
        # `clients`, aiohttp with and without trust_env). Each backend's proxy is looked up once
        # instead (leg_proxy), as httpx reads the environment once per client; ~/.netrc is not
        # read (proxy credentials go in the proxy's URL; docs/router.md)
        # keepalive_timeout (--keepalive): an idle pooled connection is closed here before the
        # server closes it (vLLM's uvicorn after VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default;
        # aiohttp's own default is 15 s), so a leg is not sent on a connection the server is
        # closing at that moment (a walkthrough saw one such leg fail with a connection reset)
        self.legs = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=c.max_connections, limit_per_host=0,
                                           keepalive_timeout=c.keepalive),
            timeout=aiohttp.ClientTimeout(total=None, connect=c.timeout,
                                          sock_connect=c.connect_timeout, sock_read=c.timeout),
            skip_auto_headers=("Accept-Encoding",), auto_decompress=False,  # bytes as sent
            trace_configs=_leg_traces())
        for b in self.prefill_pool.backends + self.decode_pool.backends:
            self.refresh_build(b)
        if c.mode == "push":
            self.adopt(asyncio.get_running_loop().create_task(self._baseline_refusals()))
        # (not adopted: it may wait minutes for a backend that is not up yet)
        self._limits_task = asyncio.get_running_loop().create_task(self._check_limits())

    async def _check_limits(self) -> None:
        """P/D pairs started with different ``--max-model-len`` (``limits.py``): said once."""
        def found(pairs: list[dict]) -> None:
            self.limit_mismatches = pairs
            for m in pairs:
                logger.warning("%s", limits.describe(m))

        async def read(url: str, proxy: str | None) -> dict[str, int] | None:
            assert self.legs is not None
            return await limits.read_lengths(self.legs, url, proxy)
        await limits.check_at_start({b.url: b.proxy for b in self.prefill_pool.backends},
                                    {b.url: b.proxy for b in self.decode_pool.backends},
                                    read, found)

    async def stop(self) -> None:
        if self._limits_task is not None:
            self._limits_task.cancel()
            await asyncio.gather(self._limits_task, return_exceptions=True)
        await self.releaser.close()
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()
        if self.legs is not None:
            await self.legs.close()

    # -- bookkeeping ---------------------------------------------------------------------------

    def failure(self, ex: Exchange | None, leg: str, url: str,
                exc: Exception | LegResponse) -> UpstreamError:
        """Classify a failure, count and log it once, and build the client's error.

        The log line names the backend; the client's error never does (nor the exception, which
        may carry an address): it says which leg failed and how. An upstream 4xx with an
        OpenAI-style error body goes to the client as the backend wrote it."""
        server, body = f"the {leg} server", None
        response = isinstance(exc, LegResponse)
        if response:
            kind, status = f"http_{exc.status_code // 100}xx", exc.status_code
            upstream, error_body = _upstream_message(exc)
            msg = f"{server} returned HTTP {status}: {without_addresses(upstream)}"
            if status < 500:
                body = error_body
        elif isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout
                        | aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
            kind, status, msg = "connect", 502, f"cannot connect to {server}"
        elif isinstance(exc, httpx.TimeoutException | asyncio.TimeoutError):  # (not connecting)
            kind, status, msg = "timeout", 504, f"{server} timed out"
        elif isinstance(exc, EmptyStream):
            kind, status, msg = "empty_stream", 502, (
                f"{server} ended the stream without any output (the request failed there; its "
                "log says why)")
        elif isinstance(exc, ValueError):
            kind, status, msg = "bad_response", 502, f"{server} sent a response that is not JSON"
        else:
            kind, status, msg = "transport", 502, f"{server} failed ({type(exc).__name__})"
        self.metrics.upstream_errors.labels(leg=leg, kind=kind).inc()
        err = UpstreamError(leg, kind, status, msg, body=body)
        args = ("tid=%s %s leg %s (%s): %s backend %s: %s", ex.tid if ex else "-", leg,
                "rejected the request" if err.rejected else "failed", kind, leg, url,
                msg if response else repr(exc))
        if kind == "connect":  # one per request while a backend is down: once a minute
            self._log.warn(f"{leg} connect {url}", *args)
        else:
            logger.log(logging.INFO if err.rejected else logging.WARNING, *args)
        return err

    def first_token_off(self, endpoint: str, body: dict) -> str | None:
        """Why a request's first token is not taken from P (``first_token.py``), or None."""
        if self.config.mode != "push" or not wants_stream(body):
            return "not_streaming" if self.config.mode == "push" else self.config.mode
        if self.config.first_token_from_prefill == "off":
            return "off"
        return ineligible(body, chat=endpoint.endswith("chat/completions"))

    async def _decode_alone(self, ex: Exchange, headers: dict, reason: str) -> DecodeStream:
        """Send the client's request to D alone, as it came (no P leg, no kv_transfer_params):
        for what vLLM cannot disaggregate. Beam search: vLLM runs it as requests of its own
        whose sampling parameters do not carry the leg's kv_transfer_params, so P's prefill
        would be thrown away (and, in push mode, P's answer would look like a P that holds no
        prefills: ``_check_held``) while D computes the prompt anyway. Prompt logprobs
        (``wants_prompt_logprobs``): D computes the prompt itself, P's KV unread."""
        ex.alone = reason
        ex.p.release()  # P never has it: no slot of P's to hold, nothing to release
        self.metrics.decode_alone.labels(reason=reason).inc()
        ex.d_task = asyncio.ensure_future(self._open_decode(ex, ex.body, headers))
        stream = await self._await(ex, ex.d_task)
        self.decode_answered(ex, stream)
        if stream.output:
            self._first_token_sent(ex, "decode", ex.first_token_off or reason)
        return stream

    def decode_answered(self, ex: Exchange, d: DecodeStream) -> None:
        """D's leg answered: note whether it produced output, and (push mode, unless D got it
        alone) that this P/D pair works."""
        ex.decode_output = d.output
        if not d.output:  # its stream opened with an error event: passed on, counted --
            # as a rejection where the event says 4xx (the client's request, e.g. a token id
            # outside the vocabulary: vLLM answers 200, then such an event), as for a 4xx status
            ex.outcome = "rejected" if d.refused else "decode_error"
        elif self.config.mode == "push" and not ex.alone and d.status_code < 400:
            ex.p.backend.kv_unreachable = None
            # D's output through this P: its kv= works, whatever P's answers name (a port
            # mapping, address translation): no more kv_mismatch for it
            ex.p.backend.kv_proven, ex.p.backend.kv_mismatch = True, None
            p_url, d_url, spec = ex.p.backend.url, ex.d.backend.url, ex.p.backend.spec
            if self.compat.worked(p_url, d_url) and spec is not None and spec.kv is not None:
                self._rebase(p_url, spec.kv, d_url)

    def _rebase(self, p_url: str, kv: str, d_url: str) -> None:
        """A pair with refusals on record worked: read D's count now, in the background, so
        a later refusal marks the pair at once (``compat``, module doc)."""
        async def read() -> None:
            self.compat.rebase(p_url, kv, d_url, await self._read_refusals(d_url))

        self.adopt(asyncio.get_running_loop().create_task(read()))

    def refresh_build(self, backend: Backend, force: bool = False) -> None:
        """(push, first token from P) read ``backend``'s build in the background where its
        reading is missing or stale, or ``force`` (``builds.py``)."""
        if not self._read_builds or self.legs is None \
                or not (force or backend.up(time.monotonic())):
            return  # (a backend that is down is read when it is back: _post_leg)
        gen = self.builds.begin(backend.url, force)
        if gen is None:
            return
        session, url, proxy = self.legs, backend.url, backend.proxy

        async def read() -> None:
            try:
                build, why = await read_build(session, url, proxy)
            except asyncio.CancelledError:
                self.builds.cancelled(url, gen)
                raise
            except Exception as e:  # never into a task nobody awaits
                logger.exception("reading the build of %s failed", url)
                build, why = None, f"{type(e).__name__}: {e}"
            self.builds.record(url, gen, build, why, name=f"{backend.role} {url}")

        self.adopt(asyncio.get_running_loop().create_task(read()))

    def common_build(self, ex: Exchange) -> Build | None:
        """The vLLM build ``ex``'s P and every D its leg may still go to (its own, and any other
        that is up: ``_next_decode``) run, as last read (``builds.py``); None if not one."""
        now = time.monotonic()
        ds = {ex.d.backend.url} | {b.url for b in self.decode_pool.backends if b.up(now)}
        return self.builds.common(ex.p.backend.url, ds)

    def _first_token_sent(self, ex: Exchange, source: str, reason: str) -> None:
        if not ex.stream:
            return
        if self.config.mode == "push":
            self.metrics.first_token.labels(path=source, reason=reason).inc()
        self.metrics.first_token_seconds.labels(**ex.labels, source=source).observe(
            time.perf_counter() - ex.t0)

    def release(self, ex: Exchange) -> None:
        """(push mode) ``ex`` ended without D's output: D's engine may never have seen it, so
        nobody else will make P let go of its prefill -- queue a ``Release`` of its transfer id
        to P's side channel (sent in the background)."""
        spec = ex.p.backend.spec
        if self.config.mode != "push" or spec is None or spec.kv_host is None or ex.p_unsent \
                or ex.alone:
            return
        assert spec.kv_port is not None
        self.releaser.release(spec.kv_host, spec.kv_port, ex.tid)

    def adopt(self, task: asyncio.Task) -> None:
        """Keep a background task (a P leg that outlives its exchange, a refusal count read)
        until it ends (cancelled at shutdown)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _note_late_prefill(self, task: asyncio.Task) -> None:
        """Done-callback for a P leg still running when D produced output."""
        if not task.cancelled() and task.exception() is not None:
            self.metrics.late_prefill_failures.inc()

    # -- legs ----------------------------------------------------------------------------------

    async def _post_leg(self, backend: Backend, endpoint: str, data: bytes, headers: dict,
                        sent: asyncio.Future | None = None) -> LegResponse:
        """POST one leg to ``backend`` (its response's headers read; raises LEG_ERRORS). A
        connection that cannot be made takes the backend out of selection for a while
        (``pool``); one that is made puts it back. ``data``: the body, as ``Exchange.encode``
        writes it. ``sent``: set once the request's headers are written (its connection was
        made), long before the answer."""
        assert self.legs is not None
        try:
            resp = await self.legs.post(backend.url + endpoint, data=data,
                                        headers={**headers, "Content-Type": "application/json"},
                                        allow_redirects=False, proxy=backend.proxy,
                                        trace_request_ctx=sent)
        except CONNECT_ERRORS:
            self._not_connected(backend)
            raise
        self._connected(backend)
        return LegResponse(resp)

    def _not_connected(self, backend: Backend) -> None:
        """A connection to ``backend`` could not be made: out of selection for a while."""
        self.builds.forget(backend.url)  # it may come back as another build
        ejections = backend.ejections
        wait = backend.unreachable(time.monotonic())
        if backend.ejections > ejections:  # taken out now (not a probe of one already out)
            self.metrics.ejections.labels(role=backend.role).inc()
        # once a minute while it lasts (the rest at DEBUG): a backend that is down is
        # tried by every request while no other of its role is up
        self._log.warn(f"unreachable {backend.url}", "%s %s cannot be connected to (%d in "
                       "a row): left out of selection for %.0fs", backend.role,
                       backend.url, backend.connect_failures, wait)

    def _connected(self, backend: Backend) -> None:
        """A connection to ``backend`` was made: back in selection, its build read again."""
        if backend.reachable():
            logger.info("%s %s can be connected to again", backend.role, backend.url)
            self.refresh_build(backend, force=True)  # it may have been restarted with another

    async def _prefill_leg(self, ex: Exchange, body: dict, headers: dict,
                           sent: asyncio.Future | None = None) -> dict:
        """POST the P leg; return its JSON (streamed: ``{"sse": its events}`` as soon as they
        hold P's token, the rest read in the background: ``_finish_prefill_leg``). Releases
        P's slot when the leg ends, however it ends. ``sent``: ``_post_leg``'s."""
        url = ex.p.backend.url
        reading_on = False
        try:
            try:
                resp = await self._post_leg(ex.p.backend, ex.endpoint, ex.encode(body),
                                            headers, sent)
                if body.get("stream") and resp.status_code < 400:
                    # one token, streamed: its events (first_token.py), once they hold it
                    sse, reading_on = await self._prefill_events(ex, resp)
                    return {"sse": sse}
                try:
                    await resp.aread()
                finally:
                    await resp.aclose()
                if resp.status_code >= 400:
                    raise self.failure(ex, "prefill", url, resp)
                if timing.ENABLED:
                    timing.stamp("router_p_done", ex.tid)
                data = resp.json()
                if not isinstance(data, dict):
                    raise ValueError("response is not a JSON object")
                if not resp.strict:  # D's body may carry what P answered (the serial path)
                    ex.strict_json = False
            except (*LEG_ERRORS, ValueError) as exc:
                # not connected: P never had it, nothing there to release
                ex.p_unsent = isinstance(exc, CONNECT_ERRORS)
                raise self.failure(ex, "prefill", url, exc) from None
            if self.config.mode == "push":
                self._check_held(ex, data)
            if self.config.mode == "upstream-push":
                self._learn_peer(url, data.get("kv_transfer_params"))
            return data
        finally:
            if not reading_on:
                ex.p.release()

    async def _prefill_events(self, ex: Exchange, resp: LegResponse) -> tuple[bytes, bool]:
        """A streamed P leg's events up to the one that ends P's choice (``PrefillAnswerHead``),
        and whether the rest is still being read (``_finish_prefill_leg``, which then releases
        P's slot)."""
        try:
            sse = await resp.read_head(PrefillAnswerHead())
        except BaseException:
            await resp.aclose()
            raise
        if timing.ENABLED:
            timing.stamp("router_p_done", ex.tid)
        if resp.at_eof:
            await resp.aclose()
            return sse, False
        # P's usage chunk, [DONE]: read on in the background, so the connection is reused
        self.adopt(asyncio.get_running_loop().create_task(self._finish_prefill_leg(ex, resp)))
        return sse, True

    async def _finish_prefill_leg(self, ex: Exchange, resp: LegResponse) -> None:
        """Read the rest of a streamed P leg whose token is already out (``_prefill_leg``), so
        that its connection is reused; then release P's slot (unless the exchange's end did
        already: ``Exchange.close``)."""
        try:
            await resp.aread()
        except LEG_ERRORS as exc:  # the token was P's whole answer: nothing of it is lost
            logger.debug("tid=%s: the end of P's answer could not be read: %r", ex.tid, exc)
        except Exception:  # never into a task nobody awaits
            logger.exception("tid=%s: reading the end of P's answer failed", ex.tid)
        finally:
            await resp.aclose()
            ex.p.release()

    async def _open_decode(self, ex: Exchange, body: dict, headers: dict) -> DecodeStream:
        """Send the D leg and wait for its first bytes (its whole body when not streaming). A
        decode server that cannot be connected to (nothing was sent) is replaced by another
        one that is up, if any: the leg does not name its D (P waits for whichever D
        registers the transfer)."""
        tried: set[str] = set()
        data = ex.encode(body)  # once: a leg moving on to another D sends the same
        while True:
            url = ex.d.backend.url
            try:
                resp = await self._post_leg(ex.d.backend, ex.endpoint, data, headers)
                break
            except LEG_ERRORS as exc:
                tried.add(url)
                if not isinstance(exc, CONNECT_ERRORS) or not self._next_decode(ex, tried):
                    raise self.failure(ex, "decode", url, exc) from None
                self.metrics.upstream_errors.labels(leg="decode", kind="connect").inc()
                self.metrics.leg_retries.labels(leg="decode").inc()
                logger.warning("tid=%s decode leg: cannot connect to %s (%r); sent to %s "
                               "instead", ex.tid, url, exc, ex.d.backend.url)
        try:
            if resp.status_code >= 400:
                await resp.aread()
                if resp.status_code >= 500:
                    await self._explain_decode_failure(ex)
                raise self.failure(ex, "decode", url, resp)
            rest: AsyncIterator[bytes] | None = None
            if ex.stream:
                # up to D's first output, error or end: a chat stream's role chunk comes first
                # even when the request then fails (sse.py)
                rest = resp.aiter_bytes()
                head = StreamHead()
                async for chunk in rest:
                    if head.feed(chunk) is not None:
                        break
                first, kind = head.data, head.end()
                output = kind == "output"
                refused = kind == "error" and head.error_status is not None \
                    and 400 <= head.error_status < 500
                if refused:  # counted and logged as a 4xx status is (failure())
                    self.metrics.upstream_errors.labels(leg="decode", kind="http_4xx").inc()
                    logger.info("tid=%s decode leg: the server refused the request after its "
                                "200 (an error event with code %d); passed on as sent", ex.tid,
                                head.error_status)
                elif not output:  # no output at all, and not the client's request refused
                    # (an error event with a 4xx code, as with a 4xx status)
                    await self._explain_decode_failure(ex)
                    if kind == "done":
                        raise self.failure(ex, "decode", url, EmptyStream())
                    # D failed the request after its 200: passed on as sent, and counted and
                    # logged as a failed non-streamed leg is (failure())
                    self.metrics.upstream_errors.labels(leg="decode", kind="error_event").inc()
                    logger.warning("tid=%s decode leg failed (error_event): decode backend %s: "
                                   "its stream's first event is an error: %s", ex.tid, url,
                                   without_addresses(first.decode("utf-8", "replace").strip()
                                                     [-300:]))
            else:
                first = await resp.aread()
                output, refused = True, False
            self.metrics.ttfb.labels(**ex.labels).observe(time.perf_counter() - ex.t0)
            if timing.ENABLED:
                timing.stamp("router_first_byte", ex.tid)
            return DecodeStream(resp, first, rest, output, refused)
        except BaseException as exc:
            await resp.aclose()
            if isinstance(exc, LEG_ERRORS):
                raise self.failure(ex, "decode", url, exc) from None
            raise

    def _next_prefill(self, ex: Exchange, tried: set[str]) -> bool:
        """Move ``ex`` (neither leg sent yet) to another prefill server that is up and not in
        ``tried``, and choose its decode server again for that P (``compat``); False when
        there is none."""
        lease = _acquire_up(self.prefill_pool, tried)
        if lease is None:
            return False
        ex.p.release()
        ex.p, ex.p_unsent = lease, False
        ex.d.release()  # (first: least-outstanding must not count the old slot)
        d = self.decode_pool.acquire(avoid=self.compat.avoided(lease.backend.url))
        assert d is not None
        ex.d = d
        return True

    async def _send_prefill_first(self, ex: Exchange, headers: dict) -> None:
        """Concurrent modes: start the P leg and return once its connection is made (its
        headers are written) or it ended, so that D's leg, which names this P's side channel,
        goes out only to wait for a P that has the request. A P that cannot be connected to
        (nothing was sent: it holds nothing) is replaced by another one that is up, if any; so
        a dead P costs no client its request while another P is up, and when none is, the
        client's 502 comes without D ever getting a leg it would wait on for nothing."""
        tried: set[str] = set()
        loop = asyncio.get_running_loop()
        while True:
            sent = loop.create_future()
            ex.p_task = asyncio.ensure_future(
                self._prefill_leg(ex, self._prefill_body(ex), headers, sent))
            try:
                await asyncio.wait({sent, ex.p_task, ex.disconnect},
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                connected = sent.done()
                sent.cancel()  # (a no-op once set)
            if ex.disconnect.done():
                raise ClientGone
            if connected or not ex.p_task.done() or ex.p_task.cancelled() \
                    or ex.p_task.exception() is None:  # (exception(): retrieved, never logged)
                return  # connected (or answered: a hook that did not fire): dispatch goes on
            # P's leg failed before its headers went out: nothing of it reached P
            if not ex.p_unsent:  # not a connect failure (a reset pooled connection, a proxy
                ex.p_task.result()  # refusing): the client's error, and D gets nothing
            url = ex.p.backend.url
            tried.add(url)
            if not self._next_prefill(ex, tried):
                ex.p_task.result()  # raises P's connect failure: D got nothing
            self.metrics.leg_retries.labels(leg="prefill").inc()
            logger.warning("tid=%s prefill leg: cannot connect to %s; sent to %s instead",
                           ex.tid, url, ex.p.backend.url)

    def _next_decode(self, ex: Exchange, tried: set[str]) -> bool:
        """Move ``ex``'s D leg to another decode server that is up and not in ``tried``
        (preferring one compatible with its P); False when there is none."""
        lease = _acquire_up(self.decode_pool, tried, avoid=self.compat.avoided(ex.p.backend.url))
        if lease is None:
            return False
        ex.d.release()
        ex.d = lease
        return True

    async def _read_refusals(self, d_url: str) -> dict[str, tuple[str, float]] | None:
        """D's KV handshake refusals by producer side channel (``compat.parse_refusals``);
        None when D's ``/metrics`` cannot be read (not "no refusals": ``PairCompat.judge``)."""
        assert self.client is not None
        try:
            r = await self.client.get(d_url + "/metrics", timeout=self.config.health_probe_timeout)
        except httpx.HTTPError:
            return None
        return parse_refusals(r.text) if r.status_code == 200 else None

    async def _every_decoders_refusals(self) -> list[tuple[str, dict | None]]:
        """(decode URL, ``_read_refusals``) for every decoder, read at once."""
        decodes = self.decode_pool.backends
        found = await asyncio.gather(*(self._read_refusals(d.url) for d in decodes))
        return [(d.url, f) for d, f in zip(decodes, found)]

    def _producer_kvs(self) -> dict[str, str]:
        """Each prefill URL's side channel HOST:PORT (``kv=``), where it has one."""
        return {p.url: p.spec.kv for p in self.prefill_pool.backends
                if p.spec is not None and p.spec.kv is not None}

    async def _baseline_refusals(self) -> None:
        """(push) Every decoder's KV handshake refusals as this router starts are history
        (``compat``, module doc): a pair fixed before is not reported incompatible on them."""
        kvs = self._producer_kvs()
        for d_url, found in await self._every_decoders_refusals():
            if found is not None:
                self.compat.baseline(kvs, d_url, found)

    async def _explain_decode_failure(self, ex: Exchange) -> None:
        """(push mode) D failed the request: if it is because D refused this P at the KV
        handshake, raise that as the client's error. vLLM records the refusal in /metrics
        in the same engine step that failed the request, so a short retry covers the race
        between D's response and its metrics. With no refusal, the router dials P's side
        channel itself (``kv=``, the address D was sent to): if that fails, that is the
        client's error."""
        spec = ex.p.backend.spec
        if self.config.mode != "push" or spec is None or spec.kv is None or ex.alone:
            return
        for attempt in range(3):
            found = self.compat.judge(spec.url, spec.kv, ex.d.backend.url,
                                      await self._read_refusals(ex.d.backend.url))
            if found is not None:
                self.metrics.upstream_errors.labels(leg="decode", kind="incompatible").inc()
                logger.warning("tid=%s decode leg failed: %s", ex.tid, found.message())
                raise UpstreamError("decode", "incompatible", 500, found.client_message(),
                                    "incompatible_peers")
            if attempt < 2:
                await asyncio.sleep(0.2)
        # no refusal: can P's side channel be reached at all, at the kv= D was sent to? (a
        # wrong kv= port, P down: D's own answer is only "Internal server error")
        assert spec.kv_host is not None and spec.kv_port is not None
        problem = await probe_side_channel(spec.kv_host, spec.kv_port, self.releaser.codec,
                                           self.config.health_probe_timeout)
        ex.p.backend.kv_unreachable = problem  # shown by /health until it answers again
        if problem is not None:
            self.metrics.upstream_errors.labels(leg="decode", kind="kv_unreachable").inc()
            logger.warning("tid=%s decode leg failed; prefill %s: %s (its kv= on this router?)",
                           ex.tid, spec.url, problem)
            cause = problem.partition(": ")[2] or problem  # without "KV side channel H:P"
            raise UpstreamError(
                "decode", "kv_unreachable", 502,
                "the decode server could not load the prompt's KV, and the prefill server's KV "
                "side channel, at the address this router gives decoders for it (kv=), does not "
                f"answer: {without_addresses(cause)}", "kv_side_channel_unreachable")
        if ex.p.backend.kv_mismatch:  # kv= answers, but P names another side channel
            self.metrics.upstream_errors.labels(leg="decode", kind="kv_mismatch").inc()
            logger.warning("tid=%s decode leg failed; prefill %s: %s (kv= crossed with another "
                           "P's?)", ex.tid, spec.url, ex.p.backend.kv_mismatch)
            raise UpstreamError(
                "decode", "kv_mismatch", 502, "the decode server failed the request, and the "
                "router's kv= for this prefill server is not the side channel that server "
                "names in its answers (kv= crossed with another prefill server's? see the "
                "router's log and /health)", "kv_side_channel_mismatch")

    def _note_rejected_by_prefill_alone(self, ex: Exchange, err: UpstreamError) -> None:
        """P rejected a request (4xx) that D had not rejected within the grace: the two do not
        accept the same requests -- most often a different ``--max-model-len`` -- and every
        such request fails with P's error while D's ``/v1/models`` (the router's) promises
        more. Counted, and said at most once a minute per P/D pair."""
        p_url, d_url = ex.p.backend.url, ex.d.backend.url
        self.metrics.prefill_rejected_alone.labels(backend=p_url).inc()
        self._log.warn(f"rejected_alone {p_url} {d_url}",
                       "prefill server %s rejected a request that decode server %s did not "
                       "(tid=%s: %s): if they were started with different limits "
                       "(--max-model-len, --max-num-seqs, the model's), every such request "
                       "fails with P's error; start P and D with the same ones",
                       p_url, d_url, ex.tid, err.message[:240])

    def _check_held(self, ex: Exchange, data: dict) -> None:
        """(push) A kv-push producer answers a P leg whose prefill it holds for D with the
        leg's transfer id; an answer without it means D gets no KV and computes the prompt
        itself. Said (at most once a minute per backend), counted, and shown by ``/health``
        until the backend's next answer holds again."""
        backend = ex.p.backend
        params = data.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("transfer_id") == ex.tid:
            backend.not_held = None
            self._check_kv(backend, params.get("side_channel"))
            return
        backend.not_held = ("its answers do not hold prefills for a KV transfer (no "
                            "kv_transfer_params.transfer_id): decode servers compute prompts "
                            "themselves")
        self.metrics.prefill_not_held.labels(backend=backend.url).inc()
        self._log.warn(f"not_held {backend.url}",
                       "prefill server %s answered transfer %s without holding its prefill "
                       "for a KV transfer: D computes the prompt itself. Is it a kv-push "
                       "producer (KVPushConnector, kv_role kv_producer)? Are --prefill and "
                       "--decode swapped? Its vllm:kv_push_rejected counter names the reason",
                       backend.url, ex.tid)

    def _check_kv(self, backend: Backend, named: Any) -> None:
        """(push) P's answer names its side channel (rank 0's ``HOST:PORT``, since 2026-12-06):
        a port other than ``kv=``'s, or another IP address, means D is sent elsewhere (two
        ``--prefill`` with crossed ``kv=``): D registers this P's transfers at another P or at
        nothing, and every request through this P fails after D's ``transfer_timeout_s``.
        Said (at most once a minute), counted and shown by ``/health``; a D failure through
        this P then names it. A host name against an address is not compared, nor a wildcard;
        behind a port mapping the ports differ by design: the check then warns wrongly until a
        D produced output through this P (``kv_proven``), and requests are served as before."""
        spec = backend.spec
        if not isinstance(named, str) or spec is None or spec.kv_host is None \
                or backend.kv_proven:
            backend.kv_mismatch = None
            return
        problem = kv_mismatch(spec.kv_host, spec.kv_port, named)
        if problem is None:
            backend.kv_mismatch = None
            return
        backend.kv_mismatch = problem
        self.metrics.kv_mismatch.labels(backend=backend.url).inc()
        self._log.warn(f"kv_mismatch {backend.url}", "prefill server %s: %s; D registers its "
                       "transfers there and they never pair (requests fail after D's "
                       "transfer_timeout_s). Check this --prefill's kv= (crossed with another "
                       "P's?); behind a port mapping or address translation, ignore this",
                       backend.url, problem)

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
        """The P leg's body: one token, not streamed (streamed where the client's first token
        comes from P: ``first_token.py``), with the mode's ``kv_transfer_params``.

        push mode, ``n > 1``: P prefills each prompt once (``n: 1``) and each prefill serves the
        ``n`` samples D makes of it (``fanout: n``, covered by the signature). Not with a
        ``best_of`` (vLLM 0.32's completions API has none; whoever has one gets the body as is).
        (Beam search, where ``n`` is the beam width, never gets here: ``_decode_alone``.)
        """
        body = dict(ex.body, max_tokens=1, stream=False)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body.pop("min_tokens", None)  # min_tokens > 1 would make vLLM reject it
        # P's one token is thrown away unless it is greedy (first_token.py), and a greedy token
        # does not depend on a seed; a seed only gives P's engine a per-request generator, and
        # vLLM's CPU build (0.32) dies on one when the prompt is prefilled in chunks
        # ("CPU Generator does not use offset": a P with --max-num-batched-tokens below the
        # prompt, seen by a walkthrough on 2026-12-06; a single server dies the same way)
        body.pop("seed", None)
        streamed = self.config.mode == "push" and ex.first_token_off is None
        if not streamed:  # vLLM refuses stream_options on a request that does not stream
            body.pop("stream_options", None)
        if self.config.mode != "push":
            body["kv_transfer_params"] = dict(PULL_PREFILL_PARAMS)
            return body
        if streamed:
            # its one token as D would stream it (first_token.py), with the client's
            # stream_options: with continuous usage P's events carry the usage a single
            # server's first events carry
            body["stream"] = True
        params: dict[str, Any] = {"transfer_id": ex.tid, "do_remote_decode": True}
        n = body.get("n")
        if type(n) is int and 1 < n <= MAX_FANOUT and body.get("best_of") is None:
            body["n"], params["fanout"] = 1, n
        body["kv_transfer_params"] = self.signer.sign(params)
        return body

    def _concurrent(self, ex: Exchange) -> bool:
        """Whether D's leg goes out beside P's (``_decode_params`` is not None)."""
        return self.config.mode == "push" or (
            self.config.mode == "upstream-push" and bool(self.peers.get(ex.p.backend.url)))

    def _decode_params(self, ex: Exchange) -> dict | None:
        """D's ``kv_transfer_params`` for the concurrent modes; ``None`` means "ask P first"."""
        if not self._concurrent(ex):
            return None
        spec = ex.p.backend.spec
        assert spec is not None
        if self.config.mode == "push":
            return self.signer.sign({"transfer_id": ex.tid, "do_remote_prefill": True,
                                     "remote_host": spec.kv_host, "remote_port": spec.kv_port})
        peer = self.peers[spec.url]  # upstream-push, P's engine id known (_concurrent)
        # remote_request_id: present (metadata.py indexes it) but None (P's id is unknown).
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": peer.engine_id, "remote_request_id": None,
                "remote_host": spec.kv_host, "remote_port": spec.kv_port,
                "tp_size": peer.tp_size, "pp_size": peer.pp_size}

    async def _await(self, ex: Exchange, task: asyncio.Task) -> Any:
        """Wait for one leg; raise :class:`ClientGone` if the client leaves first."""
        await asyncio.wait({task, ex.disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if ex.disconnect.done():
            raise ClientGone
        return task.result()

    async def dispatch(self, ex: Exchange, request: Request
                       ) -> DecodeStream | PrefillFirstStream:
        """Run the legs until D has produced output; raise UpstreamError / ClientGone."""
        headers = {"X-Request-Id": ex.leg_request_id}
        if auth := request.headers.get("authorization"):
            headers["Authorization"] = auth
        if lax_true(ex.body.get("use_beam_search")):
            return await self._decode_alone(ex, headers, "beam_search")
        if wants_prompt_logprobs(ex.body, chat=ex.endpoint.endswith("chat/completions")):
            return await self._decode_alone(ex, headers, "prompt_logprobs")
        if self._concurrent(ex):  # P first, D once P has the request
            await self._send_prefill_first(ex, headers)
        else:
            ex.p_task = asyncio.ensure_future(self._prefill_leg(ex, self._prefill_body(ex),
                                                                headers))
        d_params = self._decode_params(ex)
        if d_params is None:  # serial: pull, or upstream-push before P's engine id is known
            p_json = await self._await(ex, ex.p_task)
            # upstream-push: P's reply taught us its engine id (_prefill_leg); D gets the same
            # params as a concurrent leg, not P's verbatim (docs/router.md says why).
            d_params = self._decode_params(ex) or p_json.get("kv_transfer_params")
            if not d_params:
                logger.warning("tid=%s: P returned no kv_transfer_params; D will recompute",
                               ex.tid)
            d_body = dict(ex.body, kv_transfer_params=d_params) if d_params else ex.body
            ex.d_task = asyncio.ensure_future(self._open_decode(ex, d_body, headers))
            stream = await self._await(ex, ex.d_task)
            self.decode_answered(ex, stream)
            if stream.output:
                self._first_token_sent(ex, "decode", ex.first_token_off or "")
            return stream

        d_body = dict(ex.body, kv_transfer_params=d_params)
        ex.d_task = asyncio.ensure_future(self._open_decode(ex, d_body, headers))
        if timing.ENABLED:
            timing.stamp("router_legs_sent", ex.tid)
        if ex.first_token_off is None:  # readings older than builds.MAX_AGE_S: read again
            # (after the legs' tasks: a reading's GET goes out behind them), P's and those of
            # every decoder P's token must suit (common_build), chosen by this request or not
            self.refresh_build(ex.p.backend)
            for b in self.decode_pool.backends:
                self.refresh_build(b)
        waiting: set[asyncio.Future] = {ex.p_task, ex.d_task, ex.disconnect}
        p_error: UpstreamError | None = None  # P's 4xx, while D may still answer
        first_reason = ""  # why P's first token, once P answered, could not be used
        loop = asyncio.get_running_loop()
        deadline = 0.0
        while True:
            timeout = None if p_error is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED,
                                         timeout=timeout)
            if not done:  # D did not answer in time: P's error is the client's
                assert p_error is not None
                self._note_rejected_by_prefill_alone(ex, p_error)
                raise p_error
            if ex.disconnect in done:
                raise ClientGone
            if ex.d_task in done:
                stream = ex.d_task.result()  # a D failure raises here; close() cancels P
                self.decode_answered(ex, stream)
                if stream.output:  # (an error event is not a first token)
                    self._first_token_sent(ex, "decode", first_reason or ex.first_token_off or
                                           "decode_first")
                if ex.p_task.done():
                    self._note_late_prefill(ex.p_task)
                else:
                    ex.p_task.add_done_callback(self._note_late_prefill)
                return stream
            waiting.discard(ex.p_task)
            try:
                p_out = ex.p_task.result()  # a P failure before D's output raises; close()
                # cancels D
                if ex.first_token_off is None:
                    chat = ex.endpoint.endswith("chat/completions")
                    ex.build_checked = self.common_build(ex)
                    got = first_token_events(p_out.get("sse") or b"", chat,
                                             replacement_ok=ex.build_checked is not None)
                    if isinstance(got, tuple):
                        # an empty token (held-back bytes) is P's, but shows the client no text
                        text = got[1]  # empty: held-back bytes; U+FFFD: same build
                        self._first_token_sent(ex, "prefill", "empty_text" if not text else (
                            "partial_character" if "\ufffd" in text else ""))
                        if timing.ENABLED:
                            timing.stamp("router_first_byte", ex.tid, source="prefill")
                        return PrefillFirstStream(ex, got[0], got[1], chat)
                    first_reason = got
            except UpstreamError as err:
                if not 400 <= err.status < 500:
                    raise
                # P rejected the request: D's answer (to the client's own body) is preferred
                p_error, deadline = err, loop.time() + DECODE_ANSWER_GRACE_S

    async def handle(self, request: Request, endpoint: str) -> Response:
        """Serve one completions / chat completions request."""
        labels = {"endpoint": endpoint, "mode": self.config.mode}
        try:
            body, strict = read_body(await request.body())
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
        except ValueError as exc:
            self.metrics.requests.labels(**labels, outcome="bad_request").inc()
            return _error_response(400, f"invalid JSON body: {exc}", "invalid_request_error")
        if body.pop("kv_transfer_params", None) is not None:
            # the router's to set: a client's would reach a leg that gets none of ours (pull,
            # or D when P returned none) and make its connector act on client-chosen
            # addresses; the legs get only the router's, signed where a secret is set
            logger.debug("router: a client's kv_transfer_params dropped")
        ex = Exchange(self, endpoint, body, request, strict_json=strict)
        handed_off = False
        try:
            d = await self.dispatch(ex, request)
            if ex.stream:
                response, handed_off = ProxyStream(ex, d), True  # it closes the exchange
                return response
            return Response(d.first, status_code=d.resp.status_code,
                            media_type=d.resp.headers.get("content-type", "application/json"),
                            headers={"X-Request-Id": ex.request_id})
        except UpstreamError as err:
            # a rejection is passed on as one server alone would answer it
            ex.outcome = "rejected" if err.rejected else f"{err.leg}_error"
            return err.to_response(ex.request_id)
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
        """Backends and their outstanding legs; with ``probe`` also each one's ``/health``.
        Without it, only the side channels of P's marked ``kv_unreachable`` are dialed (again)."""
        async def check(url: str) -> str | None:  # None: healthy, else the problem
            assert self.client is not None
            try:
                r = await self.client.get(url + "/health", timeout=self.config.health_probe_timeout)
                return None if r.status_code == 200 else f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                return repr(exc)

        async def check_kv(b: Backend) -> str | None:  # (push) P's side channel as D dials it
            spec = b.spec
            if self.config.mode != "push" or spec is None or spec.kv_host is None:
                return None
            assert spec.kv_port is not None
            return await probe_side_channel(spec.kv_host, spec.kv_port, self.releaser.codec,
                                            self.config.health_probe_timeout)

        async def check_all(b: Backend) -> str | None:
            problem = await check(b.url)
            kv_problem = await check_kv(b) if b.role == "prefill" else None
            if b.role == "prefill" and self.config.mode == "push":
                b.kv_unreachable = kv_problem
            return "; ".join(p for p in (problem, kv_problem) if p) or None

        backends = self.prefill_pool.backends + self.decode_pool.backends
        problems = await asyncio.gather(*(check_all(b) for b in backends)) if probe else []
        if not probe:
            # a P whose side channel did not answer after a failed request is dialed again:
            # /health must not stay 503 once it answers (a readiness check that takes the
            # router out of service would keep it out: no request would clear it)
            flagged = [b for b in self.prefill_pool.backends if b.kv_unreachable]
            for b, kv_problem in zip(flagged, await asyncio.gather(*(check_kv(b)
                                                                     for b in flagged))):
                b.kv_unreachable = kv_problem
        if probe and self.config.mode == "push":  # what each D says about each P
            kvs = self._producer_kvs()
            for d_url, found in await self._every_decoders_refusals():
                for p_url, kv in kvs.items():
                    self.compat.judge(p_url, kv, d_url, found)
        incompatible = [i.as_dict() for i in self.compat.incompatible.values()]
        pairs = len(self.prefill_pool.backends) * len(self.decode_pool.backends)
        now = time.monotonic()
        down = any(not b.up(now) for b in backends)  # could not be connected to (pool.py)
        # 503 when nothing can be served: a backend fails its probe, every pair is
        # incompatible, or every backend of one role is left out (could not be connected to)
        role_down = any(all(not b.up(now) for b in pool.backends)
                        for pool in (self.prefill_pool, self.decode_pool))
        unusable = any(problems) or len(incompatible) == pairs or role_down
        not_held = any(b.not_held or b.kv_mismatch for b in self.prefill_pool.backends)
        kv_flagged = [b for b in self.prefill_pool.backends if b.kv_unreachable]
        # every P's side channel failed the router's dial after a request D failed: nothing can
        # be transferred (a wrong kv= on every --prefill, P's side channel down)
        unusable = unusable or len(kv_flagged) == len(self.prefill_pool.backends)
        info: dict[str, Any] = {
            "status": "degraded" if any(problems) or incompatible or down or not_held
            or kv_flagged else "ok",
            "mode": self.config.mode, "prefill": [], "decode": [], "incompatible": incompatible,
            "limit_mismatches": self.limit_mismatches}
        for i, b in enumerate(backends):
            entry: dict[str, Any] = {"url": b.url, "outstanding": b.outstanding}
            if not b.up(now):
                entry.update(down_for_s=round(b.down_until - now, 1),
                             connect_failures=b.connect_failures)
            if b.spec is not None:
                entry["kv"] = b.spec.kv
            if b.not_held:
                entry["not_held"] = b.not_held
            if b.kv_unreachable:
                entry["kv_unreachable"] = b.kv_unreachable
            if b.kv_mismatch:
                entry["kv_mismatch"] = b.kv_mismatch
            if self._read_builds:  # (first token from P) what it runs, as last read
                entry["build"] = self.builds.shown(b.url)
            if probe:
                entry.update(healthy=problems[i] is None, error=problems[i])
            info[b.role].append(entry)
        return JSONResponse(info, status_code=503 if unusable else 200)

    async def forward(self, request: Request, path: str) -> Response:
        """Send ``request`` (method, body, ``Authorization``) to ``path`` on a decode server
        and return its answer as is: for what every server answers alike (``/v1/models``,
        ``/version``, ``/tokenize``, ``/detokenize``: one model and tokenizer behind the
        router). The decode servers are tried in their order, those up (not left out of
        selection after a failed connection) first; one that cannot be connected to passes
        the request to the next. When none can, or one times out, the usual OpenAI-style 502
        / 504."""
        assert self.client is not None
        headers = {k: v for k, v in request.headers.items()
                   if k in ("authorization", "content-type")}
        body, now = await request.body(), time.monotonic()
        backends = self.decode_pool.backends
        order = [b for b in backends if b.up(now)] + [b for b in backends if not b.up(now)]
        err: UpstreamError | None = None
        for b in order:
            try:
                r = await self.client.request(request.method, b.url + path, content=body,
                                              headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                err = self.failure(None, "decode", b.url, exc)  # the next one may answer
                self._not_connected(b)
                continue
            except httpx.HTTPError as exc:
                return self.failure(None, "decode", b.url, exc).to_response(None)
            self._connected(b)
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        assert err is not None
        return err.to_response(None)


class RouterApp:
    """The router's ASGI app: the two completion endpoints go straight to :meth:`Router.handle`;
    every other request, and the lifespan, to the FastAPI app (``fastapi``).

    FastAPI's routing, request validation and middleware layers run before the handler, and its
    exception middleware wraps every ``send`` of the stream: on the client's first token, for
    endpoints that take the raw body anyway. Measured (``bench_router_overhead.py --gap-s 0.01
    --prompt-tokens 512``, ``benchmarks/results/router_overhead.idle512.*``): the router's added
    latency 0.15-0.25 ms lower, inside its run-to-run spread. A failure in ``handle`` reaches
    uvicorn as it would through FastAPI's error middleware (a 500 and the traceback in the
    log). Middleware or exception handlers added to ``fastapi`` do not see those two
    endpoints."""

    HOT = frozenset(("/v1/completions", "/v1/chat/completions"))

    def __init__(self, fastapi: FastAPI, router: Router) -> None:
        self.fastapi, self.router = fastapi, router

    @property
    def state(self) -> Any:
        return self.fastapi.state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path, root = scope["path"], scope.get("root_path", "")
            if root and path.startswith(root):  # (uvicorn --root-path: the path includes it)
                path = path[len(root):]
            if path in self.HOT:
                response = await self.router.handle(Request(scope, receive), path)
                await response(scope, receive, send)
                return
        await self.fastapi(scope, receive, send)


def build_app(config: RouterConfig) -> RouterApp:
    """The router as an ASGI app (``app.state.router`` is the :class:`Router`; ``app.fastapi``
    the FastAPI app behind it, which does not see the completion endpoints: ``RouterApp``)."""
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

    @app.post("/v1/completions")  # (served by RouterApp; here for the OpenAPI schema)
    async def completions(request: Request) -> Response:
        return await router.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")  # (served by RouterApp; here for the OpenAPI schema)
    async def chat_completions(request: Request) -> Response:
        return await router.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.forward(request, "/v1/models")

    @app.get("/version")  # as a vLLM server answers it (a decode server's)
    async def version(request: Request) -> Response:
        return await router.forward(request, "/version")

    # `vllm bench serve` aligns its prompts to the server's tokenizer through these
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await router.forward(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await router.forward(request, "/detokenize")

    @app.get("/health")
    async def health(probe: bool = False) -> Response:
        return await router.health(probe)

    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's alias of /health (SageMaker)
    async def ping() -> Response:
        return await router.health(False)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return RouterApp(app, router)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``kv-push-router``."""
    config, log_level = parse_args(argv)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every leg at INFO ("HTTP Request: POST ..."): two lines per request on the
    # critical path, next to uvicorn's access line for the client's request; --log-level debug
    # keeps them
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    logger.info("mode=%s prefill=%s decode=%s first-token-from-prefill=%s", config.mode,
                [f"{p.url} (kv {p.kv})" for p in config.prefill], list(config.decode),
                config.first_token_from_prefill)
    try:
        app = build_app(config)  # reads the shared secret (KV_PUSH_SECRET / _FILE)
    except SecretError as exc:  # as the command line's errors: one line, exit status 2
        print(f"kv-push-router: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level)


if __name__ == "__main__":
    main()
