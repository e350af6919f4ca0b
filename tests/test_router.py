"""Router tests against fake vLLM servers, everything real HTTP on loopback (no vLLM, fast)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_push.common.messages import Codec, Release, ReleaseAck
from kv_push.common.router.app import (PULL_PREFILL_PARAMS, Router, build_app, leg_proxy,
                                        redacted)
from kv_push.common.router.config import RouterConfig, parse_args, parse_prefill_spec
from kv_push.common.router.pool import Backend, BackendPool
from kv_push.common.side_channel import SideChannelServer
from kv_push.common.testing.ports import free_ports

try:
    from tests.fake_vllm import FakeVLLM, bind, free_port, serve_all
except ModuleNotFoundError:  # rootdir-less import (tests/ has no __init__.py)
    from fake_vllm import FakeVLLM, bind, free_port, serve_all

def _free_base(count: int = 3) -> int:
    """A base port with ``count`` free ports after it (the fake producers' side channels)."""
    return free_ports(count)


KV_BASE_PORT = _free_base()  # P i's side channel: KV_BASE_PORT + i (rank r of P 0: + r)


class SideChannelRecorder:
    """A producer's side channel as the router meets it: a real ``SideChannelServer`` that
    records every ``Release`` it takes (transfer ids, in order) and answers with ``ports``.
    ``gate`` (set by default) holds the answer while cleared: a P whose side channel hangs."""

    def __init__(self, port: int, ports: tuple[int, ...] | None = None,
                 secret: bytes | None = None) -> None:
        self.port = port
        self.ports = ports or (port,)
        self.releases: list[str] = []
        self.batches = 0
        self.rejects: list[str] = []
        self.probes = 0
        self.gate = threading.Event()
        self.gate.set()
        self.srv = SideChannelServer(
            "127.0.0.1", port, Codec(secret), on_hello=self._no_hello,
            on_reject=lambda reason, detail: self.rejects.append(reason), timeout=5.0,
            on_release=self._take,
            on_release_reject=lambda reason, detail: self.rejects.append(reason),
            on_probe=self._probed).start()

    def _probed(self, peer: str) -> None:
        self.probes += 1

    @staticmethod
    def _no_hello(hello):
        raise RuntimeError("no decoders here")

    def _take(self, rel: Release) -> ReleaseAck:
        self.gate.wait(30)
        self.releases.extend(rel.transfer_ids)
        self.batches += 1
        return ReleaseAck(accepted=len(rel.transfer_ids), side_channel_ports=self.ports)

    def close(self) -> None:
        self.gate.set()
        self.srv.close()


COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 16}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
        "max_completion_tokens": 16}


@dataclass
class Cluster:
    prefills: list[FakeVLLM]
    decodes: list[FakeVLLM]
    router: Router
    client: httpx.AsyncClient
    side_channels: list[SideChannelRecorder] = field(default_factory=list)

    async def metrics(self) -> dict[tuple[str, tuple], float]:
        """Samples of /metrics as {(name, sorted label items): value}."""
        text = (await self.client.get("/metrics")).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


@contextlib.asynccontextmanager
async def cluster(n_p: int = 1, n_d: int = 1, mode: str = "push", dead_decode: bool = False,
                  prefill_opts: str = "", p_tp: int = 1, side_channels: bool = True,
                  release_timeout: float = 5.0, first_token: str = "off", timeout: float = 10.0,
                  dead_decodes: int = 0, dead_prefills: int = 0,
                  decode_metrics: str = "",
                  before_start: Callable[[list, list], None] | None = None
                  ) -> AsyncIterator[Cluster]:
    """Fake P/D servers plus a router in front of them, all on loopback ports; with
    ``side_channels`` each P's side channel (``p_tp`` ranks for P 0) is a recorder.
    ``dead_decodes`` / ``dead_prefills``: that many more backends first in the router's lists,
    at ports nothing listens on. ``decode_metrics``: what each D's ``/metrics`` says from the
    start (before the router's first read)."""
    prefills = [FakeVLLM(f"p{i}", "prefill", kv_port=KV_BASE_PORT + i) for i in range(n_p)]
    decodes = [FakeVLLM(f"d{i}") for i in range(n_d)]
    for d in decodes:
        d.behavior.metrics_text = decode_metrics or d.behavior.metrics_text
    if before_start is not None:  # (what the router reads at its start-up)
        before_start(prefills, decodes)
    p_socks = [bind() for _ in prefills]
    d_socks = [bind() for _ in decodes]
    d_urls = [url for _, url in d_socks]
    if dead_decode:
        d_urls = [f"http://127.0.0.1:{free_port()}"]
    d_urls = [f"http://127.0.0.1:{free_port()}" for _ in range(dead_decodes)] + d_urls
    dead_p = [parse_prefill_spec(f"http://127.0.0.1:{free_port()},kv=127.0.0.1:{free_port()}")
              for _ in range(dead_prefills)]
    config = RouterConfig(
        prefill=tuple(dead_p) + tuple(
            parse_prefill_spec(f"{url},kv=127.0.0.1:{KV_BASE_PORT + i}{prefill_opts}")
            for i, (_, url) in enumerate(p_socks)),
        decode=tuple(d_urls), mode=mode, timeout=timeout, release_timeout=release_timeout,
        first_token_from_prefill=first_token)
    app = build_app(config)
    r_sock, r_url = bind()
    apps = [(f.app, sock) for f, (sock, _) in zip(prefills + decodes, p_socks + d_socks)]
    recorders: list[SideChannelRecorder] = []
    try:
        if side_channels:
            if p_tp > 1:
                ports = tuple(KV_BASE_PORT + r for r in range(p_tp))
                recorders = [SideChannelRecorder(p, ports) for p in ports]
            else:
                recorders = [SideChannelRecorder(KV_BASE_PORT + i) for i in range(n_p)]
        async with serve_all(apps + [(app, r_sock)]):
            # trust_env off: the test's own client never goes through a proxy variable a test
            # sets for the router's legs
            async with httpx.AsyncClient(base_url=r_url, timeout=10, trust_env=False) as client:
                # the router's start-up reads (D's refusals, builds) are done: what a test sets
                # on a fake from here on is news to the router
                await eventually(lambda: not app.state.router._background,
                                 "the router's start-up reads")
                yield Cluster(prefills, decodes, app.state.router, client, recorders)
    finally:
        for rec in recorders:
            rec.close()


async def eventually(pred: Callable[[], bool], what: str, timeout: float = 3.0) -> None:
    """Poll ``pred`` until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for: {what}")
        await asyncio.sleep(0.01)


_ROUTER_COROUTINES = {"_prefill_leg", "_open_decode", "_wait_disconnect", "_pump"}


def all_idle(c: Cluster) -> bool:
    """No outstanding legs, no adopted P legs, and no router task left in the loop."""
    backends = c.router.prefill_pool.backends + c.router.decode_pool.backends
    leftovers = [t for t in asyncio.all_tasks()
                 if getattr(t.get_coro(), "__name__", None) in _ROUTER_COROUTINES]
    # the legs' aiohttp pool: no connection still checked out (a response never released)
    legs = c.router.legs
    checked_out = len(getattr(legs.connector, "_acquired", ())) if legs is not None else 0
    return (all(b.outstanding == 0 for b in backends) and not c.router._background
            and not leftovers and checked_out == 0)


async def post(c: Cluster, endpoint: str, body: dict) -> tuple[int, bytes, httpx.Headers]:
    """POST through the router; for streams collect every byte."""
    async with c.client.stream("POST", endpoint, json=body) as r:
        data = b"".join([chunk async for chunk in r.aiter_bytes()])
        return r.status_code, data, r.headers


ENDPOINTS = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]


# -- push mode ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint,base", ENDPOINTS)
async def test_push_dispatches_both_legs_concurrently(endpoint: str, base: dict, stream: bool):
    body = dict(base, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        p.behavior.delay = 0.3  # P is slow: D must start long before it finishes
        d.behavior.delay, d.behavior.n_chunks = 0.05, 4
        status, data, headers = await post(c, endpoint, body)
        assert status == 200
        await eventually(lambda: bool(p.records) and p.records[0].completed, "P leg to finish")
        (prec,), (drec,) = p.records, d.records
        assert data == drec.sent and drec.completed  # the client got exactly D's output
        tid = headers["x-request-id"]
        assert len(tid) == 32 and prec.request_id == drec.request_id == tid
        assert drec.start < (prec.end or float("inf")), "legs did not overlap"
        assert prec.path == drec.path == endpoint
        # P leg: one token, not streamed, our transfer params.
        assert prec.body["max_tokens"] == 1 and prec.body["stream"] is False
        assert "stream_options" not in prec.body
        if "max_completion_tokens" in base:
            assert prec.body["max_completion_tokens"] == 1
        assert prec.kv == {"transfer_id": tid, "do_remote_decode": True}
        # D leg: the client's body, plus where to expect the KV from.
        assert drec.body == dict(body, kv_transfer_params={
            "transfer_id": tid, "do_remote_prefill": True,
            "remote_host": "127.0.0.1", "remote_port": KV_BASE_PORT})
        if stream:
            assert data.endswith(b"data: [DONE]\n\n") and data.count(b"data: ") == 5
        else:
            assert json.loads(data) == drec.response_json
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_push_signs_both_legs_with_the_secret(monkeypatch, caplog):
    """With KV_PUSH_SECRET the router signs each leg's kv_transfer_params (auth.py); the
    connector verifies them with the same code. A client's own params never pass through."""
    from kv_push.common.connector_scheduler import TransferParams, TransferParamsError

    monkeypatch.setenv("KV_PUSH_SECRET", "router-secret")
    monkeypatch.delenv("KV_PUSH_SECRET_FILE", raising=False)
    client_params = {"transfer_id": "mine", "do_remote_prefill": True,
                     "remote_host": "attacker.example", "remote_port": 9, "kv_push_sig": "x"}
    with caplog.at_level("WARNING", logger="kv_push.router"):
        async with cluster() as c:
            (p,), (d,) = c.prefills, c.decodes
            status, _, headers = await post(c, "/v1/completions",
                                            dict(COMPLETION, kv_transfer_params=client_params))
            assert status == 200
            await eventually(lambda: bool(p.records) and p.records[0].completed, "P leg")
            tid = headers["x-request-id"]
            dp = TransferParams.parse(d.records[0].kv, b"router-secret")
            assert (dp.transfer_id, dp.do_remote_prefill, dp.remote_host, dp.remote_port) == (
                tid, True, "127.0.0.1", KV_BASE_PORT)
            pp = TransferParams.parse(p.records[0].kv, b"router-secret")
            assert (pp.transfer_id, pp.do_remote_decode) == (tid, True)
            for kv in (d.records[0].kv, p.records[0].kv):
                assert "router-secret" not in json.dumps(kv)
                with pytest.raises(TransferParamsError):
                    TransferParams.parse(kv, b"another-secret")
    assert not any("unsigned" in r.getMessage() for r in caplog.records)
    assert not any("router-secret" in r.getMessage() for r in caplog.records)


async def test_push_without_a_secret_warns_that_params_go_out_unsigned(monkeypatch, caplog):
    monkeypatch.delenv("KV_PUSH_SECRET", raising=False)
    monkeypatch.delenv("KV_PUSH_SECRET_FILE", raising=False)
    with caplog.at_level("WARNING", logger="kv_push.router"):
        async with cluster() as c:
            status, _, _ = await post(c, "/v1/completions", COMPLETION)
            assert status == 200
            assert "kv_push_sig" not in c.decodes[0].records[0].kv
    assert any("unsigned" in r.getMessage() for r in caplog.records)


def test_upstream_push_with_a_secret_warns_that_nothing_will_be_transferred(monkeypatch, caplog):
    from kv_push.common.router.app import build_app
    from kv_push.common.router.config import parse_args

    config, _ = parse_args(["--mode", "upstream-push", "--prefill",
                            "http://127.0.0.1:1,kv=127.0.0.1:2,engine_id=e", "--decode",
                            "http://127.0.0.1:3"])
    monkeypatch.delenv("KV_PUSH_SECRET_FILE", raising=False)
    monkeypatch.delenv("KV_PUSH_SECRET", raising=False)
    with caplog.at_level("WARNING", logger="kv_push.router"):
        build_app(config)
    assert not any("upstream-push with a secret" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("KV_PUSH_SECRET", "s3cret")
    with caplog.at_level("WARNING", logger="kv_push.router"):
        build_app(config)
    assert any("upstream-push with a secret" in r.getMessage() for r in caplog.records)
    assert not any("s3cret" in r.getMessage() for r in caplog.records)


async def test_completion_endpoints_bypass_fastapi_and_the_rest_goes_through_it(monkeypatch):
    """RouterApp hands POST /v1/completions and /v1/chat/completions to Router.handle itself
    (FastAPI's layers cost the first token ~0.2 ms each way); everything else, other methods on
    those paths included, and the lifespan go to the FastAPI app."""
    from fastapi.responses import PlainTextResponse

    from kv_push.common.router.config import parse_args

    config, _ = parse_args(["--prefill", "http://127.0.0.1:1,kv=127.0.0.1:2",
                            "--decode", "http://127.0.0.1:3"])
    monkeypatch.delenv("KV_PUSH_SECRET", raising=False)
    app = build_app(config)
    handled, passed = [], []

    async def handle(request, endpoint):
        handled.append((request.method, endpoint))
        return PlainTextResponse("ok")

    async def fastapi(scope, receive, send):
        passed.append((scope["type"], scope.get("method"), scope.get("path")))

    monkeypatch.setattr(app.state.router, "handle", handle)
    app.fastapi = fastapi
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    def http(method, path):
        return {"type": "http", "method": method, "path": path, "headers": [],
                "query_string": b"", "root_path": ""}

    await app(http("POST", "/v1/completions"), receive, send)
    await app(http("POST", "/v1/chat/completions"), receive, send)
    # behind uvicorn --root-path the scope's path includes the root path
    await app(dict(http("POST", "/api/v1/completions"), root_path="/api"), receive, send)
    await app(http("GET", "/v1/completions"), receive, send)
    await app(http("GET", "/health"), receive, send)
    await app({"type": "lifespan"}, receive, send)
    assert handled == [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                       ("POST", "/v1/completions")]
    assert passed == [("http", "GET", "/v1/completions"), ("http", "GET", "/health"),
                      ("lifespan", None, None)]
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200] * 3


async def test_a_failure_in_the_router_is_a_500_as_through_fastapi(monkeypatch):
    """RouterApp passes an exception of Router.handle to the ASGI server, which answers 500
    (and logs the traceback), as FastAPI's error middleware did for these endpoints."""
    from kv_push.common.router.config import parse_args

    config, _ = parse_args(["--prefill", "http://127.0.0.1:1,kv=127.0.0.1:2",
                            "--decode", "http://127.0.0.1:3"])
    monkeypatch.delenv("KV_PUSH_SECRET", raising=False)
    app = build_app(config)

    async def handle(request, endpoint):
        raise RuntimeError("a bug in the router")

    monkeypatch.setattr(app.state.router, "handle", handle)
    sock, url = bind()
    async with serve_all([(app, sock)]):
        async with httpx.AsyncClient(base_url=url, timeout=10, trust_env=False) as client:
            r = await client.post("/v1/completions", json=COMPLETION)
            assert r.status_code == 500
            assert (await client.get("/health")).status_code in (200, 503)  # still serving


async def test_push_late_prefill_failure_lets_decode_finish():
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        p.behavior.delay, p.behavior.fail_status = 0.2, 500
        d.behavior.n_chunks, d.behavior.chunk_interval = 8, 0.05
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, stream=True))
        assert status == 200 and data == d.records[0].sent and d.records[0].completed
        m = await c.metrics()
        assert m[("kv_push_router_late_prefill_failures_total", ())] == 1
        await eventually(lambda: all_idle(c), "router to be idle")
        assert m[("kv_push_router_upstream_errors_total",
                  (("kind", "http_5xx"), ("leg", "prefill")))] == 1


# -- push: releasing P's prefill of an exchange that ended without D's output -------------------


async def _ended_without_output(c: Cluster, how: str) -> str:
    """Run one exchange that ends before D produced output; returns its transfer id."""
    (p,), (d,) = c.prefills, c.decodes
    if how == "client_gone":  # the client hangs up while D has not answered yet
        d.behavior.delay = 10.0
        with pytest.raises(httpx.ReadTimeout):
            await c.client.post("/v1/completions", json=COMPLETION, timeout=0.3)
        await eventually(lambda: bool(p.records), "P leg")
        return p.records[-1].request_id
    if how == "decode_error":
        d.behavior.fail_status = 500
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.status_code in (500, 502)  # 502: P's side channel unreachable (explained)
    elif how == "decode_error_event":  # HTTP 200, then an error event before any output
        d.behavior.stream_error = True
        r = await c.client.post("/v1/completions", json=dict(COMPLETION, stream=True))
        assert b'"error"' in r.content
    elif how == "decode_error_event_chat":  # the same after vLLM's chat role chunk
        d.behavior.stream_error = True
        r = await c.client.post("/v1/chat/completions", json=dict(CHAT, stream=True))
        assert b'"role"' in r.content and b'"error"' in r.content
    elif how == "prefill_error":
        p.behavior.fail_status, d.behavior.delay = 500, 10.0
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 500 and r.json()["error"]["type"] == "prefill_error"
    return r.headers["x-request-id"]


@pytest.mark.parametrize("how", ["client_gone", "decode_error", "decode_error_event",
                                 "decode_error_event_chat", "prefill_error"])
async def test_an_exchange_without_decode_output_releases_its_prefill(how: str):
    async with cluster() as c:
        (sc,) = c.side_channels
        tid = await _ended_without_output(c, how)
        assert len(tid) == 32
        await eventually(lambda: sc.releases == [tid], "P to be told to release it")
        await eventually(lambda: not c.router.releaser.busy(), "releaser idle")
        m = await c.metrics()
        assert m[("kv_push_router_releases_total", (("result", "sent"),))] == 1
        assert sc.rejects == []


@pytest.mark.parametrize("how", ["decode_error_event", "decode_error_event_chat"])
async def test_a_decode_stream_that_fails_before_its_output_is_counted_and_logged(
        how: str, caplog: pytest.LogCaptureFixture):
    """As a non-streamed D failure is (a walkthrough saw a streamed one only in D's log)."""
    async with cluster() as c:
        with caplog.at_level(logging.WARNING, logger="kv_push.router"):
            tid = await _ended_without_output(c, how)
        m = await c.metrics()
        assert m[("kv_push_router_upstream_errors_total",
                  (("kind", "error_event"), ("leg", "decode")))] == 1
        (line,) = [r.getMessage() for r in caplog.records if "error_event" in r.getMessage()]
        assert tid in line and "first event is an error" in line


@pytest.mark.parametrize("endpoint,body", [("/v1/completions", COMPLETION),
                                           ("/v1/chat/completions", CHAT)])
async def test_a_stream_that_opens_with_a_4xx_error_event_is_the_clients_refusal(endpoint, body):
    """vLLM refuses some requests only once its stream has begun (HTTP 200, then an error event
    with code 400: e.g. a token id outside the vocabulary). That is the client's request, not a
    failure of D or of the KV path: the stream goes to the client as vLLM sent it, the request
    counts as rejected, P's prefill is released, and the router does not go looking for a KV
    cause (no refusal reads, no dial of P's side channel, nothing marked)."""
    async with cluster() as c:
        (sc,), (d,) = c.side_channels, c.decodes
        d.behavior.stream_error, d.behavior.stream_error_code = True, 400
        status, data, headers = await post(c, endpoint, dict(body, stream=True))
        assert status == 200 and data == d.records[-1].sent and b'"code": 400' in data
        tid = c.prefills[0].records[-1].request_id
        await eventually(lambda: sc.releases == [tid], "P to be told to release it")
        m = await c.metrics()
        assert _outcomes(m, endpoint) == {"rejected": 1}
        assert sc.probes == 0 and c.router.prefill_pool.backends[0].kv_unreachable is None
        # counted as a 4xx status is, and nothing else on D's leg
        assert {dict(k[1])["kind"]: v for k, v in m.items() if v
                and k[0] == "kv_push_router_upstream_errors_total"
                and dict(k[1]).get("leg") == "decode"} == {"http_4xx": 1}


async def test_a_4xx_error_event_after_output_is_the_decode_servers_failure():
    # once D produced output the request was accepted: a later error event is D's failure
    async with cluster() as c:
        (d,) = c.decodes
        d.behavior.error_after_output, d.behavior.stream_error_code = True, 400
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, stream=True))
        assert status == 200 and b'"code": 400' in data
        await eventually(lambda: all_idle(c), "router to be idle")
        assert _outcomes(await c.metrics(), "/v1/completions") == {"decode_error": 1}


def _outcomes(m: dict, endpoint: str) -> dict[str, float]:
    return {dict(k[1])["outcome"]: v for k, v in m.items()
            if k[0] == "kv_push_router_requests_total" and dict(k[1])["endpoint"] == endpoint}


async def test_a_chat_stream_failing_after_its_role_chunk_is_not_a_served_request():
    """vLLM's chat stream opens with a role chunk even when the request then fails (HTTP 200,
    role chunk, error event, [DONE]). The router reads past the role chunk: with D's refusal
    of this P on record the client gets the reason as an HTTP error and the pair stays listed
    as incompatible; with no reason known the stream reaches the client as vLLM sent it. Either
    way it counts as a decode error (not "ok") and P's prefill is released (D produced
    nothing)."""
    async with cluster() as c:
        (sc,), (d,) = c.side_channels, c.decodes
        d.behavior.fail_status = 500
        d.behavior.metrics_text = _refusal_metrics(f"127.0.0.1:{KV_BASE_PORT}", REFUSAL)
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.json()["error"]["type"] == "incompatible_peers"
        d.behavior.fail_status, d.behavior.stream_error = None, True
        for _ in range(2):  # twice: the first must not have cleared the pair
            r = await c.client.post("/v1/chat/completions", json=dict(CHAT, stream=True))
            assert r.status_code == 500 and r.json()["error"]["type"] == "incompatible_peers"
            assert (await c.client.get("/health")).json()["incompatible"]
        # no refusal on record (another pair, or D restarted): vLLM's stream as it is
        c.router.compat.incompatible.clear()
        c.router.compat._cleared.clear()
        d.behavior.metrics_text = ""
        status, data, headers = await post(c, "/v1/chat/completions", dict(CHAT, stream=True))
        assert status == 200 and data == d.records[-1].sent
        assert b'"role"' in data and b'"error"' in data and data.endswith(b"data: [DONE]\n\n")
        await eventually(lambda: headers["x-request-id"] in sc.releases, "P's release")
        await eventually(lambda: all_idle(c), "router to be idle")
        m = await c.metrics()
        assert _outcomes(m, "/v1/chat/completions") == {"decode_error": 3}
        assert not any(k[0] == "kv_push_router_first_token_seconds_count" and v
                       for k, v in m.items()), "an error event taken for a first token"
        assert len(sc.releases) == 4


async def test_a_stream_failing_after_output_is_counted_as_a_decode_error():
    """An error event after D's output (vLLM's way to fail a stream it has begun) is passed on
    and counted as D's error; P is not released (D's engine had the request)."""
    async with cluster() as c:
        (sc,), (d,) = c.side_channels, c.decodes
        d.behavior.error_after_output = True
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, stream=True))
        assert status == 200 and data == d.records[0].sent and b'"error"' in data
        await eventually(lambda: all_idle(c), "router to be idle")
        assert _outcomes(await c.metrics(), "/v1/completions") == {"decode_error": 1}
        assert sc.releases == []


async def test_a_client_leaving_after_the_final_done_was_served():
    """A client that reads the stream's [DONE] and hangs up at once, while D has not closed its
    body yet, had the whole response: counted "ok", not a disconnect, and P's leg is left to
    finish rather than cancelled."""
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        d.behavior.linger_after_done = 2.0
        p.behavior.delay = 1.0  # P's leg still runs when the client leaves
        async with c.client.stream("POST", "/v1/completions",
                                   json=dict(COMPLETION, stream=True)) as r:
            got = b""
            async for chunk in r.aiter_bytes():
                got += chunk
                if got.endswith(b"data: [DONE]\n\n"):
                    break
        assert got == d.records[0].sent
        await eventually(lambda: all_idle(c), "router to be idle")
        assert _outcomes(await c.metrics(), "/v1/completions") == {"ok": 1}
        assert p.records[0].completed and not p.records[0].disconnected


async def test_an_exchange_with_decode_output_releases_nothing():
    """D produced output: its engine has the request (its connector registers or cancels), so
    the router leaves P alone -- for a complete response and for a client that hangs up after
    D's first byte. A later failed exchange is released, and alone (the queue is in order)."""
    async with cluster() as c:
        (sc,), (d,) = c.side_channels, c.decodes
        status, _, _ = await post(c, "/v1/completions", COMPLETION)
        assert status == 200
        status, _, _ = await post(c, "/v1/completions", dict(COMPLETION, stream=True))
        assert status == 200
        d.behavior.n_chunks, d.behavior.chunk_interval = 200, 0.05
        async with c.client.stream("POST", "/v1/completions",
                                   json=dict(COMPLETION, stream=True)) as r:
            async for _ in r.aiter_bytes():
                break  # gone after D's first byte
        await eventually(lambda: all_idle(c), "router to be idle")
        d.behavior.n_chunks, d.behavior.chunk_interval = 3, 0.0
        tid = await _ended_without_output(c, "decode_error")
        await eventually(lambda: bool(sc.releases), "the failed exchange's release")
        assert sc.releases == [tid]


async def test_a_release_never_delays_the_response():
    """P's side channel holds its answer: the client still gets D's failure at once, and the
    release reaches P afterwards."""
    async with cluster() as c:
        (sc,) = c.side_channels
        sc.gate.clear()
        tid = await _ended_without_output(c, "decode_error")  # answered while P is held
        assert sc.releases == [] and c.router.releaser.busy()
        status, _, _ = await post(c, "/v1/completions", COMPLETION)  # and serving goes on
        assert status == 500  # (D still fails)
        sc.gate.set()
        await eventually(lambda: len(sc.releases) == 2, "the releases, once P answers")
        assert sc.releases[0] == tid


async def test_a_prefill_side_channel_down_or_hung_is_counted_not_fatal():
    async with cluster(side_channels=False, release_timeout=0.3) as c:
        (p,), (d,) = c.prefills, c.decodes
        await _ended_without_output(c, "decode_error")  # nobody listens on P's side channel
        await eventually(lambda: not c.router.releaser.busy(), "release given up")
        hung = socket.create_server(("127.0.0.1", KV_BASE_PORT))  # accepts, never answers
        try:
            await _ended_without_output(c, "decode_error")
            await eventually(lambda: not c.router.releaser.busy(), "release timed out")
        finally:
            hung.close()
        m = await c.metrics()
        errors = lambda kind: m.get(  # noqa: E731
            ("kv_push_router_release_errors_total", (("kind", kind),)), 0)
        assert errors("connect") == 1 and errors("timeout") == 1
        assert m[("kv_push_router_releases_total", (("result", "failed"),))] == 2
        d.behavior.fail_status = None
        status, _, _ = await post(c, "/v1/completions", COMPLETION)  # the router serves on
        assert status == 200


async def test_a_kv_that_is_not_the_side_channel_p_names_is_said_and_explains_d_failures(
        caplog: pytest.LogCaptureFixture):
    """A walkthrough crossed two P's kv=: D registered each P's transfers at the other, every
    request failed after D's transfer_timeout_s with a bare 500, and /health?probe=1 was 200
    (both side channels answer). P's answers name its own side channel: the router compares."""
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        p.behavior.side_channel = f"127.0.0.1:{KV_BASE_PORT + 7}"  # another P's
        d.behavior.fail_status = 500  # D gets no KV: vLLM's bare 500
        with caplog.at_level(logging.WARNING, logger="kv_push.router"):
            for _ in range(2):
                r = await c.client.post("/v1/completions", json=COMPLETION)
                # kv= answers the router's dial (another P's side channel): the mismatch
                assert r.status_code == 502, r.text
                assert r.json()["error"]["type"] == "kv_side_channel_mismatch"
        said = [r.getMessage() for r in caplog.records
                if "its side channel is at port" in r.getMessage()]
        assert len(said) == 3 and f"port {KV_BASE_PORT + 7}" in said[0]  # once a minute, + 2 D
        b = c.router.prefill_pool.backends[0]
        m = await c.metrics()
        assert m[("kv_push_router_kv_mismatch_total", (("backend", b.url),))] == 2
        assert m[("kv_push_router_upstream_errors_total",
                  (("kind", "kv_mismatch"), ("leg", "decode")))] == 2
        h = await c.client.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "degraded"
        assert "port" in h.json()["prefill"][0]["kv_mismatch"]
        # P names no side channel (an older build): nothing flagged
        p.behavior.side_channel = None
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.json()["error"]["type"] != "kv_side_channel_mismatch" and b.kv_mismatch is None
        # D produces output through it (a port mapping, say): its kv= works; not flagged again
        p.behavior.side_channel, d.behavior.fail_status = f"127.0.0.1:{KV_BASE_PORT + 7}", None
        assert (await post(c, "/v1/completions", COMPLETION))[0] == 200
        assert (await post(c, "/v1/completions", COMPLETION))[0] == 200
        h = await c.client.get("/health")
        assert h.json()["status"] == "ok" and "kv_mismatch" not in h.json()["prefill"][0]


def test_kv_mismatch_compares_ports_and_addresses_only():
    from kv_push.common.router.config import kv_mismatch

    assert kv_mismatch("127.0.0.1", 5600, "127.0.0.1:5600") is None
    assert kv_mismatch("10.0.0.1", 5600, "0.0.0.0:5600") is None  # a wildcard: not compared
    assert kv_mismatch("p-host", 5600, "10.0.0.1:5600") is None  # a name: not compared
    assert kv_mismatch("::1", 5600, "[::1]:5600") is None
    assert "port 5601" in kv_mismatch("p-host", 5600, "10.0.0.1:5601")
    assert "10.0.0.2:5600" in kv_mismatch("10.0.0.1", 5600, "10.0.0.2:5600")
    assert kv_mismatch("10.0.0.1", 5600, "garbage") is None  # not judged
    assert kv_mismatch("0.0.0.0", 5600, "127.0.0.1:5600") is None  # a wildcard either side
    assert kv_mismatch("::ffff:10.0.0.1", 5600, "10.0.0.1:5600") is None  # IPv4-mapped


@pytest.mark.parametrize("endpoint,body", [("/v1/completions", COMPLETION),
                                           ("/v1/chat/completions", dict(CHAT, stream=True))])
async def test_a_decode_failure_with_ps_side_channel_unreachable_says_so(endpoint, body):
    """D fails a request and names no refusal (vLLM: "Internal server error"): the router dials
    P's side channel at the ``kv=`` it gave D; when nothing answers there (a wrong port, P's
    worker down) the client is told that, without the address."""
    async with cluster(side_channels=False) as c:
        (d,) = c.decodes
        if body.get("stream"):
            d.behavior.stream_error = True
        else:
            d.behavior.fail_status = 500
        r = await c.client.post(endpoint, json=body)
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["type"] == "kv_side_channel_unreachable", err
        assert "Connection refused" in err["message"] and "kv=" in err["message"]
        assert "127.0.0.1" not in err["message"] and str(KV_BASE_PORT) not in err["message"]
        m = await c.metrics()
        assert m[("kv_push_router_upstream_errors_total",
                  (("kind", "kv_unreachable"), ("leg", "decode")))] == 1
        await eventually(lambda: all_idle(c), "router to be idle")
        # plain /health says so (a walkthrough saw "ok" while every request failed so): its
        # only P cannot be transferred from
        h = await c.client.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "degraded"
        (entry,) = h.json()["prefill"]
        assert "Connection refused" in entry["kv_unreachable"]
        # until a request through it works
        d.behavior.stream_error, d.behavior.fail_status = False, None
        status, _, _ = await post(c, "/v1/completions", COMPLETION)
        assert status == 200
        h = await c.client.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "ok"
        assert "kv_unreachable" not in h.json()["prefill"][0]


async def test_a_side_channel_that_answers_again_clears_health_without_a_request():
    # plain /health dials a P marked kv_unreachable again: a readiness check that took the
    # router out of service must see it come back (no request would clear it)
    async with cluster(side_channels=False) as c:
        c.decodes[0].behavior.fail_status = 500
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.json()["error"]["type"] == "kv_side_channel_unreachable"
        assert (await c.client.get("/health")).status_code == 503  # still not answering
        side = SideChannelRecorder(KV_BASE_PORT)  # P's side channel is back
        try:
            h = await c.client.get("/health")
            assert h.status_code == 200 and h.json()["status"] == "ok", h.json()
        finally:
            side.close()


async def test_a_prefill_server_that_does_not_hold_prefills_is_said_counted_and_shown():
    # a server that is no kv-push producer (or --prefill and --decode swapped): its answers
    # carry no transfer id, D computes every prompt itself
    async with cluster() as c:
        (p,) = c.prefills
        p.behavior.no_kv_params = True
        for _ in range(3):
            status, _, _ = await post(c, "/v1/completions", COMPLETION)
            assert status == 200  # served
        m = await c.metrics()
        url = c.router.prefill_pool.backends[0].url
        assert m[("kv_push_router_prefill_not_held_total", (("backend", url),))] == 3
        h = await c.client.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "degraded"
        assert "do not hold prefills" in h.json()["prefill"][0]["not_held"]
        p.behavior.no_kv_params = False  # its next answer holds: shown no more
        status, _, _ = await post(c, "/v1/completions", COMPLETION)
        h = await c.client.get("/health")
        assert h.json()["status"] == "ok" and "not_held" not in h.json()["prefill"][0]


async def test_a_release_reaches_every_rank_of_a_tensor_parallel_prefill():
    """Rank 0 (the side channel the router knows) names every rank's port in its answer."""
    async with cluster(p_tp=2) as c:
        r0, r1 = c.side_channels
        tid = await _ended_without_output(c, "decode_error")
        await eventually(lambda: r0.releases == r1.releases == [tid], "both ranks told")
        m = await c.metrics()
        assert m[("kv_push_router_releases_total", (("result", "sent"),))] == 1


async def test_a_storm_of_hang_ups_is_released_each_once():
    async with cluster() as c:
        (sc,), (d,) = c.side_channels, c.decodes
        d.behavior.fail_status = 500
        rs = await asyncio.gather(*(c.client.post("/v1/completions", json=COMPLETION)
                                    for _ in range(30)))
        tids = {r.headers["x-request-id"] for r in rs}
        assert len(tids) == 30
        await eventually(lambda: len(sc.releases) == 30, "every release")
        assert set(sc.releases) == tids
        print(f"\n30 releases in {sc.batches} Release frames")


async def test_releases_carry_the_routers_secret(monkeypatch):
    monkeypatch.setenv("KV_PUSH_SECRET", "router-secret")
    monkeypatch.delenv("KV_PUSH_SECRET_FILE", raising=False)
    async with cluster(side_channels=False) as c:
        good = SideChannelRecorder(KV_BASE_PORT, secret=b"router-secret")
        try:
            tid = await _ended_without_output(c, "decode_error")
            await eventually(lambda: good.releases == [tid], "an authenticated release")
        finally:
            good.close()
        other = SideChannelRecorder(KV_BASE_PORT, secret=b"another-secret")
        try:
            await _ended_without_output(c, "decode_error")
            await eventually(lambda: not c.router.releaser.busy(), "release refused")
            assert other.releases == [] and other.rejects == ["bad_mac"]
        finally:
            other.close()
        m = await c.metrics()
        assert m[("kv_push_router_release_errors_total", (("kind", "refused"),))] == 1


async def test_a_release_frees_the_prefill_on_every_real_producer_rank():
    """Two producer workers (ranks 0 and 1 of one P at TP 2, each holding its copy of the
    prefill) behind real side channels; the router's sender dials rank 0 only, as configured.
    Both ranks free their copy, and only that one."""
    from prometheus_client import CollectorRegistry, Counter

    from kv_push.common import geometry as G
    from kv_push.common.config import PushConfig
    from kv_push.common.router.release import ReleaseSender
    from kv_push.common.worker import PushWorker

    try:
        from tests.fakes import FakeTransport, Wire
    except ModuleNotFoundError:
        from fakes import FakeTransport, Wire

    wire, base = Wire(), _free_base(2)
    workers = []
    try:
        for rank in range(2):
            geometry = G.pooled(base=1 << 32, placement="kv_split", num_layers=2,
                                num_kv_heads=2, head_size=8, dtype_bytes=2, dtype="bfloat16",
                                block_size=4, num_blocks=8, tp_size=2, tp_rank=rank)
            workers.append(PushWorker(
                geometry=geometry, role="producer",
                config=PushConfig(side_channel_port=base, secret=b"k"),
                transport_factory=lambda r=rank: FakeTransport(wire, f"P{r}")).start())
        for w in workers:
            w.prefill_done("req-1", "tid-1", (0, 1), 8)
            w.prefill_done("req-2", "tid-2", (2, 3), 8)
        await eventually(lambda: all(w.live()["sources"] == 2 for w in workers), "prefills")
        reg = CollectorRegistry()
        releases = Counter("r", "", ["result"], registry=reg)
        errors = Counter("e", "", ["kind"], registry=reg)
        sender = ReleaseSender(Codec(b"k"), 5.0, releases, errors)
        sender.release("127.0.0.1", base, "tid-1")
        freed: list[list[str]] = [[], []]

        def drained() -> bool:
            for i, w in enumerate(workers):
                freed[i] += w.drain_released()
            return freed == [["req-1"], ["req-1"]]

        await eventually(drained, "both ranks to free req-1", timeout=10)
        await eventually(lambda: not sender.busy(), "sender idle")
        assert reg.get_sample_value("r_total", {"result": "sent"}) == 1
        assert all(w.counters.get("released") == 1 for w in workers)
        assert all(w.live()["sources"] == 1 for w in workers)  # tid-2 is still held
        await sender.close()
    finally:
        for w in workers:
            w.close()


async def test_only_push_mode_releases():
    async with cluster(mode="pull") as c:
        (sc,), (p,), (d,) = c.side_channels, c.prefills, c.decodes
        d.behavior.fail_status = 500
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 500
        await eventually(lambda: all_idle(c), "router to be idle")
        assert not c.router.releaser.busy() and sc.releases == []


# -- pull and upstream-push modes --------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_pull_is_serial_and_forwards_prefill_params(stream: bool):
    async with cluster(mode="pull") as c:
        (p,), (d,) = c.prefills, c.decodes
        p.behavior.delay = 0.2
        status, data, headers = await post(c, "/v1/completions", dict(COMPLETION, stream=stream))
        assert status == 200
        (prec,), (drec,) = p.records, d.records
        assert data == drec.sent
        assert drec.start >= prec.end, "pull must not start D before P finished"
        assert prec.kv == PULL_PREFILL_PARAMS and prec.body["max_tokens"] == 1
        assert drec.kv == prec.response_json["kv_transfer_params"]
        assert drec.kv["remote_engine_id"] == "engine-p0"
        assert prec.request_id == drec.request_id == headers["x-request-id"]
        await eventually(lambda: all_idle(c), "router to be idle")


@pytest.mark.parametrize("first_token", ["off", "auto"])
@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_p_s_leg_goes_without_the_seed_and_d_s_keeps_it(mode: str, first_token: str):
    """P's one token is thrown away unless it is greedy (no seed changes a greedy token), and
    vLLM 0.32's CPU engine dies on a seeded request whose prompt it prefills in chunks: P's leg
    carries no seed, D's keeps the client's (D samples every token the client gets)."""
    async with cluster(mode=mode, first_token=first_token) as c:
        (p,), (d,) = c.prefills, c.decodes
        for body in (dict(COMPLETION, temperature=0.8, seed=7),
                     dict(COMPLETION, temperature=0, seed=7, stream=True)):
            p.records.clear()
            d.records.clear()
            status, _, _ = await post(c, "/v1/completions", body)
            assert status == 200
            await eventually(lambda: bool(p.records) and p.records[0].completed, "P's leg")
            (prec,), (drec,) = p.records, d.records
            assert "seed" not in prec.body and prec.body["max_tokens"] == 1
            assert drec.body["seed"] == 7 and drec.body["temperature"] == body["temperature"]
        await eventually(lambda: all_idle(c), "router to be idle")


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_a_clients_kv_transfer_params_reach_no_leg(mode: str):
    """kv_transfer_params are the router's: a client's never reach P or D, not even where P
    returns none and D gets the client's body (pull), where they would make D's connector
    dial a host the client chose."""
    async with cluster(mode=mode) as c:
        (p,), (d,) = c.prefills, c.decodes
        p.behavior.no_kv_params = True
        evil = {"do_remote_prefill": True, "remote_host": "10.6.6.6", "remote_port": 1,
                "remote_engine_id": "evil", "remote_block_ids": [[1]]}
        status, _, _ = await post(c, "/v1/completions", dict(COMPLETION, kv_transfer_params=evil))
        assert status == 200
        (prec,), (drec,) = p.records, d.records
        for kv in (prec.kv, drec.kv):
            assert kv is None or "10.6.6.6" not in json.dumps(kv)
        if mode == "pull":
            assert drec.kv is None  # P returned none: D recomputes
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_upstream_push_learns_engine_id_then_overlaps():
    async with cluster(mode="upstream-push") as c:
        (p,), (d,) = c.prefills, c.decodes
        p.behavior.transfer_mode = "push"
        # First request: P's engine id is unknown, so P goes first; D then gets the same params
        # as a concurrent leg (not P's verbatim: remote_request_id would turn on D's heartbeats).
        p.behavior.delay = 0.2
        assert (await post(c, "/v1/completions", COMPLETION))[0] == 200
        assert d.records[0].start >= p.records[0].end
        assert d.records[0].kv == {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-p0",
            "remote_request_id": None, "remote_host": "127.0.0.1", "remote_port": KV_BASE_PORT,
            "tp_size": 1, "pp_size": 1}
        # Then both legs at once, D told P's engine id, side channel and sizes.
        p.behavior.delay = 0.4
        status, data, headers = await post(c, "/v1/chat/completions", dict(CHAT, stream=True))
        assert status == 200 and data == d.records[1].sent
        prec, drec = p.records[1], d.records[1]
        # D began while P still ran (P may not even have ended yet)
        assert drec.start < (prec.end or float("inf")), "legs did not overlap"
        assert prec.kv == PULL_PREFILL_PARAMS
        assert drec.kv == {"do_remote_prefill": True, "do_remote_decode": False,
                           "remote_engine_id": "engine-p0", "remote_request_id": None,
                           "remote_host": "127.0.0.1",
                           "remote_port": KV_BASE_PORT, "tp_size": 1, "pp_size": 1}
        # NixlPushConnector pairs the legs by request id: same header, same endpoint.
        assert prec.request_id == drec.request_id == headers["x-request-id"]
        assert prec.path == drec.path == "/v1/chat/completions"
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_upstream_push_with_configured_engine_id_is_concurrent_at_once():
    async with cluster(mode="upstream-push", prefill_opts=",engine_id=eng-x,tp=2") as c:
        (p,), (d,) = c.prefills, c.decodes
        p.behavior.delay = 0.4
        assert (await post(c, "/v1/completions", COMPLETION))[0] == 200
        assert d.records[0].start < (p.records[0].end or float("inf"))  # while P still ran
        assert d.records[0].kv["remote_engine_id"] == "eng-x"
        assert d.records[0].kv["tp_size"] == 2
        assert "remote_request_id" in d.records[0].kv  # metadata.py:334 indexes it
        await eventually(lambda: all_idle(c), "router to be idle")


# -- backend selection -------------------------------------------------------------------------


async def test_least_outstanding_spreads_concurrent_requests():
    async with cluster(n_p=2, n_d=2) as c:
        for f in c.prefills + c.decodes:
            f.behavior.delay = 0.3
        results = await asyncio.gather(*(post(c, "/v1/completions", COMPLETION) for _ in range(4)))
        assert all(r[0] == 200 for r in results)
        assert [len(f.records) for f in c.prefills + c.decodes] == [2, 2, 2, 2]
        # Each request's legs carry one transfer id, and the D leg names its own P's channel.
        for d in c.decodes:
            for rec in d.records:
                (prec,) = [r for p in c.prefills for r in p.records
                           if r.request_id == rec.request_id]
                owner = next(i for i, p in enumerate(c.prefills) if prec in p.records)
                assert rec.kv["remote_port"] == KV_BASE_PORT + owner
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_busy_decode_is_avoided():
    async with cluster(n_d=2) as c:
        d0, d1 = c.decodes
        d0.behavior.delay = 1.0  # the first request lands on d0 (round robin) and stays there
        slow = asyncio.ensure_future(post(c, "/v1/completions", COMPLETION))
        await eventually(lambda: len(d0.records) == 1, "slow request to reach d0")
        for _ in range(3):  # d0 has 1 outstanding, d1 none: all go to d1
            assert (await post(c, "/v1/completions", COMPLETION))[0] == 200
        assert (len(d0.records), len(d1.records)) == (1, 3)
        assert (await slow)[0] == 200
        await eventually(lambda: all_idle(c), "router to be idle")


# -- failures ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_error_cancels_decode(stream: bool):
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        p.behavior.delay, p.behavior.fail_status = 0.1, 500
        d.behavior.delay = 5.0  # D waits for KV that never comes
        t0 = time.monotonic()
        r = await c.client.post("/v1/completions", json=dict(COMPLETION, stream=stream))
        assert time.monotonic() - t0 < d.behavior.delay  # answered before D would have
        assert r.status_code == 500
        err = r.json()["error"]
        assert "p0 failed" in err["message"] and err["type"] == "prefill_error"
        assert err["code"] == 500
        await eventually(lambda: bool(d.records) and d.records[0].disconnected,
                         "D leg to be cancelled")
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_decode_down_gives_502_and_cancels_prefill():
    async with cluster(dead_decode=True) as c:
        (p,) = c.prefills
        p.behavior.delay = 5.0
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["type"] == "decode_error" and err["code"] == 502
        assert err["message"] == "cannot connect to the decode server"  # not where
        # Depending on how fast D's connection is refused, the P request is cancelled before or
        # after it reached P; either way P must not keep working on it.
        await eventually(lambda: all_idle(c), "router to be idle")
        await eventually(lambda: all(rec.disconnected for rec in p.records), "P leg cancelled")
        health = await c.client.get("/health", params={"probe": "1"})
        assert health.status_code == 503 and health.json()["decode"][0]["healthy"] is False
        m = await c.metrics()
        assert m[("kv_push_router_upstream_errors_total",
                  (("kind", "connect"), ("leg", "decode")))] == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_silent_decode_server_is_a_timeout(stream):
    """D sends nothing for longer than the router's time-out: the client gets 504 (not a hang,
    not a 502), counted as a decode-leg time-out; D's leg is closed, P let go."""
    async with cluster(timeout=0.3) as c:
        (d,) = c.decodes
        d.behavior.delay = 3.0
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, stream=stream))
        assert status == 504, data
        err = json.loads(data)["error"]
        assert err["type"] == "decode_error" and err["message"] == "the decode server timed out"
        await eventually(lambda: all_idle(c), "router to be idle")
        await eventually(lambda: all(rec.disconnected or rec.completed for rec in d.records),
                         "D leg closed")
        m = await c.metrics()
        assert m[("kv_push_router_upstream_errors_total",
                  (("kind", "timeout"), ("leg", "decode")))] == 1


async def test_client_disconnect_mid_stream_cancels_both_legs():
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        p.behavior.delay = 10.0  # still prefilling when the client leaves
        d.behavior.n_chunks, d.behavior.chunk_interval = 200, 0.05
        async with c.client.stream("POST", "/v1/completions",
                                   json=dict(COMPLETION, stream=True)) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_bytes():
                assert chunk.startswith(b"data: ")
                break
        await eventually(lambda: bool(p.records) and p.records[0].disconnected, "P cancelled")
        await eventually(lambda: d.records[0].disconnected, "D cancelled")
        await eventually(lambda: all_idle(c), "router to be idle")
        m = await c.metrics()
        key = ("kv_push_router_requests_total", (("endpoint", "/v1/completions"),
                                                 ("mode", "push"),
                                                 ("outcome", "client_disconnect")))
        assert m.get(key) == 1


async def test_client_disconnect_before_response_cancels_both_legs():
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        p.behavior.delay = d.behavior.delay = 10.0
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            await c.client.post("/v1/completions", json=COMPLETION, timeout=0.3)
        await eventually(lambda: bool(p.records) and p.records[0].disconnected, "P cancelled")
        await eventually(lambda: bool(d.records) and d.records[0].disconnected, "D cancelled")
        await eventually(lambda: all_idle(c), "router to be idle")
        m = await c.metrics()
        assert m[("kv_push_router_requests_total", (("endpoint", "/v1/completions"),
                  ("mode", "push"), ("outcome", "client_disconnect")))] == 1


async def test_bad_json_is_400():
    async with cluster() as c:
        r = await c.client.post("/v1/completions", content=b"not json",
                                headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert not c.prefills[0].records and not c.decodes[0].records


@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_both_legs_get_the_clients_values_whatever_json_the_client_wrote(mode: str):
    """The router reads the client's body with msgspec and writes the legs' with it
    (``body_json``); a body msgspec refuses -- ``NaN``, ``Infinity``, a lone surrogate escape,
    all of which Python's json takes -- still reaches P and D with the values Python's json
    read. Big integers, non-ASCII text, U+2028 and escapes reach both legs unchanged; every
    leg says its body is JSON."""
    strict = (rb'{"model": "m", "prompt": "caf\u00e9 \u2028 \"q\" \\ \ud83d\ude00 '
              rb'\u00ff", "max_tokens": 16, "temperature": 0.1, "top_p": 1e-7,'
              rb' "user": "\u4e2d\u6587", "seed": 123456789012345678901234567890}')
    lax = (rb'{"model": "m", "prompt": "x \ud800 y", "max_tokens": 16, "temperature": NaN,'
           rb' "top_k": Infinity, "logit_bias": {"5": -Infinity}}')
    async with cluster(mode=mode) as c:
        (p,), (d,) = c.prefills, c.decodes
        for n, raw in enumerate((strict, lax), start=1):
            r = await c.client.post("/v1/completions", content=raw,
                                    headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
            await eventually(lambda: len(p.records) == n and p.records[-1].completed, "P leg")
            want = json.loads(raw)
            for rec, keys in ((p.records[-1], set(want) - {"max_tokens", "seed"}),
                              (d.records[-1], set(want))):
                assert rec.headers["content-type"] == "application/json"
                # repr: NaN equals nothing, and a lone surrogate is shown as its escape
                assert {k: repr(rec.body[k]) for k in keys} == {k: repr(want[k]) for k in keys}
                if raw is strict:  # written by msgspec: compact, UTF-8 as it is
                    assert b", " not in rec.raw and "caf\u00e9".encode() in rec.raw
                else:  # by Python's json, as before: NaN and the escape as it writes them
                    assert b"NaN" in rec.raw and b"\\ud800" in rec.raw
        await eventually(lambda: all_idle(c), "router to be idle")

# -- metrics, health, models -------------------------------------------------------------------


async def test_a_health_probe_checks_each_prefills_kv_side_channel():
    """``/health?probe`` dials each P's ``kv=`` side channel as a decoder would: a wrong port
    (nothing listens there) makes P unhealthy with the reason, instead of every request failing
    with D's bare "Internal server error" while the probe says all is well. The producer counts
    the probe as a probe (``side_channel_probes``), not as a failed handshake."""
    async with cluster(side_channels=False) as c:
        h = await c.client.get("/health", params={"probe": "true"})
        assert h.status_code == 503, h.json()
        (p,) = h.json()["prefill"]
        assert p["healthy"] is False
        assert f"KV side channel 127.0.0.1:{KV_BASE_PORT}" in p["error"], p
        assert h.json()["decode"][0]["healthy"] is True
        rec = SideChannelRecorder(KV_BASE_PORT)  # now P's side channel listens
        try:
            h = await c.client.get("/health", params={"probe": "true"})
            assert h.status_code == 200 and h.json()["prefill"][0]["healthy"] is True, h.json()
            await eventually(lambda: rec.probes == 1, "P to count the probe")
            assert rec.rejects == []
        finally:
            rec.close()


async def test_metrics_health_and_models():
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        for _ in range(2):
            assert (await post(c, "/v1/completions", COMPLETION))[0] == 200
        p.behavior.fail_status = 503
        d.behavior.delay = 2.0
        assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 503
        await eventually(lambda: all_idle(c), "router to be idle")
        m = await c.metrics()
        req = "kv_push_router_requests_total"
        labels = (("endpoint", "/v1/completions"), ("mode", "push"))
        assert m[(req, labels + (("outcome", "ok"),))] == 2
        assert m[(req, labels + (("outcome", "prefill_error"),))] == 1
        assert m[("kv_push_router_upstream_errors_total",
                  (("kind", "http_5xx"), ("leg", "prefill")))] == 1
        assert m[("kv_push_router_e2e_latency_seconds_count", labels)] == 3
        assert m[("kv_push_router_decode_ttfb_seconds_count", labels)] == 2
        for role, f in (("prefill", p), ("decode", d)):
            url = (c.router.prefill_pool if role == "prefill" else c.router.decode_pool
                   ).backends[0].url
            assert m[("kv_push_router_outstanding_requests",
                      (("backend", url), ("role", role)))] == 0

        h = await c.client.get("/health")
        assert h.status_code == 200
        info = h.json()
        assert info["status"] == "ok" and info["mode"] == "push"
        assert info["prefill"][0]["kv"] == f"127.0.0.1:{KV_BASE_PORT}"
        assert info["prefill"][0]["outstanding"] == 0 and len(info["decode"]) == 1
        probed = await c.client.get("/health", params={"probe": "true"})
        assert probed.status_code == 200
        assert all(b["healthy"] for b in probed.json()["prefill"] + probed.json()["decode"])

        models = await c.client.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["owned_by"] == "d0"


async def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event():
    async with cluster() as c:
        d = c.decodes[0]
        d.behavior.n_chunks, d.behavior.break_after = 6, 2
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, stream=True))
        assert status == 200  # the response had started
        events = [e for e in data.decode().split("\n\n") if e]
        assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:2]] == [
            "d0-tok0 ", "d0-tok1 "]
        err = json.loads(events[2][6:])["error"]
        assert err["type"] == "decode_error", err
        assert err["code"] == 502 and events[3] == "data: [DONE]" and len(events) == 4
        m = await c.metrics()
        assert m[("kv_push_router_requests_total", (("endpoint", "/v1/completions"),
                  ("mode", "push"), ("outcome", "decode_error")))] == 1
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_decode_dropping_the_connection_after_its_final_done():
    """D sent its whole stream, [DONE] included, then the connection broke before the body's
    end (D stopped or reset it): the client has the whole answer, once -- no error event and
    no second [DONE] after it -- and it is counted as served."""
    async with cluster() as c:
        d = c.decodes[0]
        d.behavior.break_after_done = True
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, stream=True))
        assert status == 200 and data == d.records[0].sent
        assert data.count(b"[DONE]") == 1 and b'"error"' not in data
        await eventually(lambda: all_idle(c), "router to be idle")
        assert _outcomes(await c.metrics(), "/v1/completions") == {"ok": 1}


@pytest.mark.parametrize("value, streams", [("false", False), ("no", False), (0, False),
                                            (None, False), ("true", True), ("Yes", True),
                                            (1, True)])
@pytest.mark.parametrize("endpoint, base", ENDPOINTS)
async def test_stream_is_read_as_vllm_reads_it(endpoint, base, value, streams):
    """vLLM's request models read ``stream`` leniently ("false", 0, "yes"): the router must
    read it the same way, or it takes D's JSON answer for an empty stream (a 502)."""
    async with cluster() as c:
        d = c.decodes[0]
        status, data, headers = await post(c, endpoint, dict(base, stream=value))
        assert status == 200, data
        assert data == d.records[0].sent if streams else json.loads(data) == d.records[0].response_json
        assert headers["content-type"].startswith("text/event-stream" if streams
                                                  else "application/json")
        await eventually(lambda: all_idle(c), "router to be idle")
        m = await c.metrics()
        assert not any(k[0] == "kv_push_router_upstream_errors_total" and v for k, v in m.items())


async def test_a_stream_value_vllm_rejects_is_the_backends_400():
    async with cluster() as c:
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, stream="maybe"))
        assert status == 400 and b"valid boolean" in data  # the backend's error, passed on


@pytest.mark.parametrize("mode", ["push", "pull", "upstream-push"])
async def test_the_clients_x_request_id_names_the_request_as_one_server_would(mode):
    """A client's X-Request-Id: one vLLM server names the request after it and repeats it. The
    router's legs carry it (push, pull; upstream-push pairs its legs by X-Request-Id, so they
    carry the router's unique id there), the response repeats it, and the transfer id stays
    the router's own: two requests with the same client id are two transfers."""
    async with cluster(mode=mode) as c:
        (p,), (d,) = c.prefills, c.decodes
        rs = await asyncio.gather(*(c.client.post("/v1/completions", json=COMPLETION,
                                                  headers={"X-Request-Id": "trace-7"})
                                    for _ in range(2)))
        assert [r.status_code for r in rs] == [200, 200]
        assert [r.headers["x-request-id"] for r in rs] == ["trace-7", "trace-7"]
        legs = {rec.request_id for rec in p.records + d.records}
        if mode == "upstream-push":
            assert "trace-7" not in legs and len(legs) == 2  # one unique id per exchange
        else:
            assert legs == {"trace-7"}
            assert rs[0].json()["id"] == "cmpl-trace-7"  # D's answer, named by the client
        if mode == "push":
            tids = {rec.kv["transfer_id"] for rec in p.records}
            assert len(tids) == 2 and all(len(t) == 32 for t in tids)
        await eventually(lambda: all_idle(c), "router to be idle")
        if mode != "upstream-push":  # a non-ASCII id reaches the servers as the client sent it
            # (a walkthrough saw UTF-8 ü named "cmpl-ÃÂ¼-unicode", a single server "cmpl-Ã¼-...")
            r = await c.client.post("/v1/completions", json=COMPLETION,
                                    headers={"X-Request-Id": "ü-unicode".encode()})
            as_server_reads = "ü-unicode".encode().decode("latin-1")
            assert r.json()["id"] == f"cmpl-{as_server_reads}"
            assert {rec.request_id for rec in d.records[2:]} == {as_server_reads}


# -- incompatible P/D pairs (D refused P at the KV handshake) -----------------------------------


def _refusal_metrics(address: str, reason: str, count: float = 1.0) -> str:
    label = reason.replace("\\", "\\\\").replace('"', '\\"')
    return ("# TYPE vllm:kv_push_handshake_refusals_total counter\n"
            f'vllm:kv_push_handshake_refusals_total{{engine="0",model_name="tiny",'
            f'reason="{address} {label}"}} {count}\n'
            'vllm:kv_push_handshake_refusals_total{engine="0",reason="10.9.9.9:1 other"} 3.0\n')


REFUSAL = ('bad_layout: decoder abc: opaque block layouts need equal block_size: 64 on the '
           'producer, 128 on the decoder "quoted"')


def test_parse_refusals_reads_labels_and_skips_noise():
    from kv_push.common.router.compat import parse_refusals
    text = _refusal_metrics("127.0.0.1:5600", REFUSAL, 2.0) + (
        "vllm:kv_push_handshake_refusals_created{reason=\"127.0.0.1:5600 x\"} 1.7e9\n"
        "vllm:kv_push_handshake_refusals_total{reason=\"127.0.0.1:5600 y\"} nan-ish\n"
        "vllm:kv_push_handshake_refusals_total{reason=\"nospace\"} 1.0\n")
    assert parse_refusals(text) == {"127.0.0.1:5600": (REFUSAL, 2.0), "10.9.9.9:1": ("other", 3.0)}


@pytest.mark.parametrize("stream", [False, True, "chat"])
async def test_incompatible_pair_reason_reaches_client_and_health(stream: bool | str):
    """(chat: vLLM's chat stream opens with a role chunk before its error event; the router
    reads past it, so the client still gets the reason as an HTTP error.)"""
    endpoint, body = (("/v1/chat/completions", dict(CHAT, stream=True)) if stream == "chat"
                      else ("/v1/completions", dict(COMPLETION, stream=stream)))
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        if stream:
            d.behavior.stream_error = True
        else:
            d.behavior.fail_status = 500
        d.behavior.metrics_text = _refusal_metrics(f"127.0.0.1:{KV_BASE_PORT}", REFUSAL)
        r = await c.client.post(endpoint, json=body)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "incompatible_peers", err
        assert REFUSAL in err["message"] and "incompatible" in err["message"]
        assert "127.0.0.1" not in err["message"] and "http" not in err["message"]
        h = await c.client.get("/health")
        assert h.status_code == 503  # the only pair cannot serve anything
        (inc,) = h.json()["incompatible"]
        assert inc["reason"] == REFUSAL and inc["kv"] == f"127.0.0.1:{KV_BASE_PORT}"
        assert inc["decode"] == c.router.decode_pool.backends[0].url
        m = await c.metrics()
        assert m[("kv_push_router_upstream_errors_total",
                  (("kind", "incompatible"), ("leg", "decode")))] == 1
        # the failed request is not a served one
        assert m[("kv_push_router_requests_total", (("endpoint", endpoint), ("mode", "push"),
                                                    ("outcome", "decode_error")))] == 1
        # D is reconfigured and works: the old refusals are history
        d.behavior.fail_status, d.behavior.stream_error = None, False
        assert (await post(c, "/v1/completions", COMPLETION))[0] == 200
        h = await c.client.get("/health", params={"probe": "true"})
        assert h.status_code == 200 and h.json()["incompatible"] == [], h.json()
        # a later failure with no new refusal is not blamed on the old one
        d.behavior.fail_status = 500
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 500 and r.json()["error"]["type"] == "decode_error"
        # a new refusal is
        d.behavior.metrics_text = _refusal_metrics(f"127.0.0.1:{KV_BASE_PORT}", REFUSAL, 2.0)
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.json()["error"]["type"] == "incompatible_peers"
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_a_stream_without_any_output_is_a_decode_failure():
    """vLLM 0.29 drops a failed request's error from its stream: only ``data: [DONE]`` comes.
    The router answers with an error instead of an empty 200 stream (and explains a refusal)."""
    async with cluster() as c:
        d = c.decodes[0]
        d.behavior.n_chunks = 0
        r = await c.client.post("/v1/completions", json=dict(COMPLETION, stream=True))
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["type"] == "decode_error" and "without any output" in err["message"]
        d.behavior.metrics_text = _refusal_metrics(f"127.0.0.1:{KV_BASE_PORT}", REFUSAL)
        r = await c.client.post("/v1/completions", json=dict(COMPLETION, stream=True))
        assert r.status_code == 500 and r.json()["error"]["type"] == "incompatible_peers"
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_refusal_of_another_producer_is_not_blamed():
    async with cluster(n_p=2) as c:
        d = c.decodes[0]
        d.behavior.fail_status = 500
        d.behavior.metrics_text = _refusal_metrics(f"127.0.0.1:{KV_BASE_PORT + 1}", REFUSAL)
        types = set()
        for _ in range(2):  # round robin: one request through each P
            r = await c.client.post("/v1/completions", json=COMPLETION)
            types.add(r.json()["error"]["type"])
        assert types == {"decode_error", "incompatible_peers"}
        h = await c.client.get("/health", params={"probe": "true"})
        (inc,) = h.json()["incompatible"]
        assert inc["kv"] == f"127.0.0.1:{KV_BASE_PORT + 1}"
        assert h.status_code == 200 and h.json()["status"] == "degraded"  # one pair still works
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_refusals_long_ago_do_not_make_every_success_read_decodes_metrics():
    """D refused a P once, before the router started (history at its first read). Successes
    through that pair then read D's whole /metrics after every request, for as long as D ran
    (a cold review counted 50 reads for 50 requests); now at most one per 30 s."""
    kv = f"127.0.0.1:{KV_BASE_PORT}"
    async with cluster(decode_metrics=_refusal_metrics(kv, REFUSAL, 2.0)) as c:
        reads = 0
        read = c.router._read_refusals

        async def counting(url: str):
            nonlocal reads
            reads += 1
            return await read(url)

        c.router._read_refusals = counting
        for _ in range(5):
            status, _, _ = await post(c, "/v1/completions", COMPLETION)
            assert status == 200
        await eventually(lambda: not c.router._background, "the router's reads")
        assert reads == 1  # one read per REBASE_EVERY_S (30 s) at most, not one per success
        # a refusal D counts later is still news at its failure
        d = c.decodes[0]
        d.behavior.fail_status = 500
        d.behavior.metrics_text = _refusal_metrics(kv, REFUSAL, 3.0)
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.json()["error"]["type"] == "incompatible_peers", r.text
        await eventually(lambda: all_idle(c), "router to be idle")


def test_a_pair_that_works_again_is_not_marked_on_refusals_counted_before():
    """D counted more refusals after the router's last look (several for one failed request);
    the pair then works: those refusals are history too."""
    from kv_push.common.router.compat import PairCompat

    compat = PairCompat()
    seen = lambda n: {"kv:1": (REFUSAL, float(n))}  # noqa: E731
    compat.baseline({"p": "kv:1"}, "d", {})  # (the router's read at its start: none)
    assert compat.judge("p", "kv:1", "d", seen(3)) is not None
    assert compat.worked("p", "d")  # D's count is 6 by now; the router saw 3: read it
    assert compat.judge("p", "kv:1", "d", seen(6)) is None  # no read yet: this look is it
    assert compat.incompatible == {}
    assert compat.judge("p", "kv:1", "d", seen(7)).reason == REFUSAL  # a new one counts
    # with the read the router asks for, the first new refusal after the success counts
    assert compat.worked("p", "d")
    compat.rebase("p", "kv:1", "d", seen(9))
    assert compat.judge("p", "kv:1", "d", seen(10)).reason == REFUSAL
    # a pair with no refusals on record needs no read: its first refusal counts at once
    compat.baseline({"p2": "kv:2"}, "d", {})  # (the router's read at its start)
    assert not compat.worked("p2", "d")
    assert compat.judge("p2", "kv:2", "d", {"kv:2": (REFUSAL, 1.0)}).reason == REFUSAL
    # a pair the router could not read at its start (its D not up yet): every refusal counts
    assert compat.judge("p3", "kv:3", "d", {"kv:3": (REFUSAL, 1.0)}).reason == REFUSAL
    # a /metrics that cannot be read (None) tells nothing: no false restart, no new baseline
    compat.baseline({"p4": "kv:4"}, "d", {"kv:4": (REFUSAL, 5.0)})
    assert compat.judge("p4", "kv:4", "d", None) is None
    assert compat.judge("p4", "kv:4", "d", {"kv:4": (REFUSAL, 5.0)}) is None
    assert compat.judge("p", "kv:1", "d", None).reason == REFUSAL  # (still marked)


async def test_probe_finds_an_incompatible_pair_before_any_request():
    async with cluster() as c:
        # D refused P after the router started (another router's request, say)
        c.decodes[0].behavior.metrics_text = _refusal_metrics(f"127.0.0.1:{KV_BASE_PORT}", REFUSAL)
        assert (await c.client.get("/health")).json()["incompatible"] == []  # not read yet
        h = await c.client.get("/health", params={"probe": "true"})
        assert h.status_code == 503 and h.json()["incompatible"][0]["reason"] == REFUSAL


async def test_refusals_counted_before_the_router_started_are_history():
    """A walkthrough's case: P was refused by D (another block size), then fixed, and the router
    restarted. D's counter still holds the old refusal: the new router must not report the pair
    incompatible (its /health was 503 until a request went through, which a readiness check
    that takes the router out of service never lets happen), nor blame a failure of D for
    another reason on it. A refusal after the start counts, and so does one after D restarted
    (its counter below the router's baseline)."""
    kv = f"127.0.0.1:{KV_BASE_PORT}"
    async with cluster(decode_metrics=_refusal_metrics(kv, REFUSAL, 2.0)) as c:
        (d,) = c.decodes
        for params in ({}, {"probe": "true"}):
            h = await c.client.get("/health", params=params)
            assert h.status_code == 200 and h.json()["incompatible"] == [], h.json()
        d.behavior.fail_status = 500  # D fails for another reason
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 500 and r.json()["error"]["type"] == "decode_error", r.text
        d.behavior.metrics_text = _refusal_metrics(kv, REFUSAL, 3.0)  # a new refusal
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.json()["error"]["type"] == "incompatible_peers", r.text
        d.behavior.fail_status = None
        assert (await post(c, "/v1/completions", COMPLETION))[0] == 200  # fixed again
        await eventually(lambda: not c.router._background, "the read after it worked")
        # D restarts and refuses once: its count (1) is below the router's (3), and new
        d.behavior.fail_status = 500
        d.behavior.metrics_text = _refusal_metrics(kv, REFUSAL, 1.0)
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.json()["error"]["type"] == "incompatible_peers", r.text
        await eventually(lambda: all_idle(c), "router to be idle")


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("endpoint,base", ENDPOINTS)
async def test_beam_search_goes_to_d_alone(endpoint, base, mode):
    """vLLM runs beam search as requests of its own that take no kv_transfer_params: P's
    prefill would be thrown away, and its answer (holding nothing) made a walkthrough's router
    report a healthy P as "not held" (a WARNING, a counter, /health degraded). D gets the
    request as the client sent it, P nothing; a failure of D is not blamed on the KV path."""
    body = dict(base, use_beam_search="true", n=2)  # (vLLM reads the flag laxly)
    async with cluster(mode=mode) as c:
        (p,), (d,) = c.prefills, c.decodes
        r = await c.client.post(endpoint, json=body)
        assert r.status_code == 200 and r.content == d.records[0].sent
        assert p.records == [] and d.records[0].body == body  # no kv_transfer_params
        h = await c.client.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "ok", h.json()
        m = await c.metrics()
        assert m[("kv_push_router_decode_alone_total", (("reason", "beam_search"),))] == 1
        assert not any(name == "kv_push_router_prefill_not_held_total" and v
                       for (name, _), v in m.items())
        d.behavior.fail_status = 500
        r = await c.client.post(endpoint, json=body)
        assert r.status_code == 500 and r.json()["error"]["type"] == "decode_error"
        await eventually(lambda: all_idle(c), "router to be idle")
        if mode == "push":
            (sc,) = c.side_channels
            assert sc.releases == [] and sc.probes == 0  # nothing to release, nothing dialled
        assert p.records == []


@pytest.mark.parametrize("endpoint,base,extra,alone", [
    ("/v1/completions", COMPLETION, {"prompt_logprobs": 0}, True),
    ("/v1/completions", COMPLETION, {"echo": True, "logprobs": 2}, True),
    ("/v1/completions", COMPLETION, {"echo": "yes", "logprobs": 0}, True),
    ("/v1/completions", COMPLETION, {"echo": True}, False),
    ("/v1/completions", COMPLETION, {"logprobs": 2}, False),
    ("/v1/chat/completions", CHAT, {"prompt_logprobs": 1}, True),
    ("/v1/chat/completions", CHAT, {"echo": True, "logprobs": True, "top_logprobs": 2}, True),
    ("/v1/chat/completions", CHAT, {"echo": True}, True),  # (top_logprobs defaults to 0)
    ("/v1/chat/completions", CHAT, {"logprobs": True, "top_logprobs": 2}, False),
])
async def test_prompt_logprobs_go_to_d_alone(endpoint, base, extra, alone):
    """vLLM computes the prompt of a request that wants its logprobs itself (it reads no KV it
    did not compute: a walkthrough saw P's prefill thrown away); it goes to D alone."""
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        r = await c.client.post(endpoint, json=dict(base, **extra))
        assert r.status_code == 200 and r.content == d.records[0].sent
        await eventually(lambda: all_idle(c), "router to be idle")
        assert (p.records == []) is alone and ("kv_transfer_params" in d.records[0].body) \
            is not alone
        m = await c.metrics()
        assert m.get(("kv_push_router_decode_alone_total", (("reason", "prompt_logprobs"),)),
                     0) == int(alone)


async def test_a_request_for_d_alone_holds_no_slot_of_p():
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        d.behavior.delay = 0.5
        task = asyncio.ensure_future(c.client.post(
            "/v1/completions", json=dict(COMPLETION, use_beam_search=True, n=2)))
        await eventually(lambda: bool(d.records), "D's leg")
        pb, db = c.router.prefill_pool.backends[0], c.router.decode_pool.backends[0]
        assert (pb.outstanding, db.outstanding) == (0, 1)
        assert (await task).status_code == 200
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_tokenize_goes_to_a_decode_server_and_a_dead_one_is_502():
    """``vllm bench serve`` calls /tokenize and /detokenize on the URL it benchmarks."""
    async with cluster(n_d=2) as c:
        r = await c.client.post("/tokenize", json={"model": "m", "prompt": "abc"},
                                headers={"Authorization": "Bearer k"})
        assert r.status_code == 200
        assert r.json() == {"tokens": [97, 98, 99], "count": 3, "server": "d0",
                            "authorization": "Bearer k"}
        assert (await c.client.post("/detokenize", json={"tokens": [1]})).status_code == 404
        # what else a vLLM server answers: /version (a decode server's), /ping (/health)
        assert (await c.client.get("/version")).json() == {"version": "0.32.0+fake"}
        for method in ("GET", "POST"):
            r = await c.client.request(method, "/ping")
            assert r.status_code == 200 and r.json()["status"] == "ok"
        assert not any(f.records for f in c.prefills + c.decodes)  # no legs dispatched
    async with cluster(dead_decode=True) as c:
        r = await c.client.post("/tokenize", json={"model": "m", "prompt": "abc"})
        assert r.status_code == 502 and "cannot connect" in r.json()["error"]["message"]
    # the first decode server is down: the next one answers (a walkthrough's kill -9 of the
    # first D made /v1/models and /tokenize 502 for good while completions still worked)
    async with cluster(dead_decodes=1) as c:
        for _ in range(2):
            r = await c.client.post("/tokenize", json={"model": "m", "prompt": "abc"})
            assert r.status_code == 200 and r.json()["server"] == "d0"
            assert (await c.client.get("/v1/models")).status_code == 200
        # the dead one was left out after the first try: not dialled again meanwhile
        dead = c.router.decode_pool.backends[0]
        assert not dead.up(time.monotonic())
        m = await c.metrics()
        assert m[("kv_push_router_upstream_errors_total",
                  (("kind", "connect"), ("leg", "decode")))] == 1
        assert (await c.client.post("/v1/completions", json=COMPLETION)).status_code == 200


# -- configuration -----------------------------------------------------------------------------


def test_config_parses_and_validates(capsys: pytest.CaptureFixture[str]):
    assert parse_args(["--prefill", "http://p:1,kv=h:2", "--decode", "http://d:2",
                       "--release-timeout", "1.5"])[0].release_timeout == 1.5
    cfg, _ = parse_args(["--prefill", "http://p:8100/,kv=10.0.0.1:5600", "--prefill",
                         "http://q:8100,kv=[::1]:5601", "--decode", "http://d:8200",
                         "--mode", "pull", "--timeout", "30"])
    assert cfg.mode == "pull" and cfg.timeout == 30 and cfg.port == 8000
    assert cfg.release_timeout == 5.0
    assert cfg.keepalive == 4.0  # under vLLM's own HTTP keep-alive (5 s)
    assert parse_args(["--prefill", "http://p:1,kv=h:2", "--decode", "http://d:2",
                       "--keepalive", "2.5"])[0].keepalive == 2.5
    assert cfg.host == "127.0.0.1" and cfg.decode == ("http://d:8200",)
    assert [(s.url, s.kv_host, s.kv_port) for s in cfg.prefill] == [
        ("http://p:8100", "10.0.0.1", 5600), ("http://q:8100", "::1", 5601)]
    with pytest.raises(Exception):
        cfg.mode = "push"  # type: ignore[misc]  # frozen

    bad = {
        ("--prefill", "http://p:1", "--decode", "http://d:2"): "kv=HOST:PORT",
        ("--prefill", "http://p:1,kv=h:port", "--decode", "http://d:2"): "port",
        ("--prefill", "p:1,kv=h:2", "--decode", "http://d:2"): "http(s)://",
        ("--prefill", "http://p:1,kv=h:2,color=red", "--decode", "http://d:2"): "unknown option",
        ("--prefill", "http://p:1,kv=h:2"): "--decode",
        ("--prefill", "http://p:1,kv=h:2", "--decode", "http://d:2", "--mode", "x"): "--mode",
        ("--prefill", "http://p:1,kv=h:2", "--decode", "http://p:1"): "more than once",
        ("--prefill", "http://p:1,kv=h:2", "--decode", "http://d:2", "--release-timeout", "0"):
            "--release-timeout",
        ("--prefill", "http://p:1,kv=h:2", "--decode", "http://d:2", "--keepalive", "0"):
            "--keepalive",
    }
    for argv, needle in bad.items():
        with pytest.raises(SystemExit) as exc_info:
            parse_args(list(argv))
        assert exc_info.value.code == 2
        assert needle in capsys.readouterr().err, argv

    with pytest.raises(ValueError, match="expected HOST:PORT"):
        parse_prefill_spec("http://p:1,kv=nohost")
    for host in ("p-host..example", "x" * 64 + ".example"):  # no socket can dial these
        with pytest.raises(ValueError, match="is not a valid host name"):
            parse_prefill_spec(f"http://p:1,kv={host}:5600")
    assert parse_prefill_spec("http://p:1,kv=[::1]:5600").kv_host == "::1"
    assert parse_prefill_spec("http://p:1,kv=p-host.example:5600").kv_host == "p-host.example"
    assert parse_prefill_spec("http://p:1").kv is None  # fine for pull mode
    with pytest.raises(ValueError, match="needs kv=HOST:PORT"):
        RouterConfig(prefill=(parse_prefill_spec("http://p:1"),), decode=("http://d:2",))


def test_one_side_channel_for_two_prefill_servers_is_refused(caplog):
    """A walkthrough's copy-paste: both P given kv=...:18701. D registered one P's transfers at
    the other, which never paired: a bare 500 after transfer_timeout_s."""
    same = (parse_prefill_spec("http://p:1,kv=h:5600"), parse_prefill_spec("http://q:1,kv=h:5600"))
    with pytest.raises(ValueError, match=r"kv= side channel given for more than one --prefill: "
                                         r"h:5600 \(http://p:1, http://q:1\)"):
        RouterConfig(prefill=same, decode=("http://d:2",))
    RouterConfig(prefill=same, decode=("http://d:2",), mode="pull")  # pull does not dial kv=
    RouterConfig(prefill=(same[0], parse_prefill_spec("http://q:1,kv=h:5601")),
                 decode=("http://d:2",))
    # upstream-push's fields are ignored in push mode: said at start-up
    from kv_push.common.router.app import Router

    with caplog.at_level(logging.WARNING, logger="kv_push.router"):
        Router(RouterConfig(prefill=(parse_prefill_spec("http://p:1,kv=h:1,engine_id=e"),),
                            decode=("http://d:2",)))
    assert any("ignored in --mode push" in r.getMessage() for r in caplog.records)


# -- backend pool ------------------------------------------------------------------------------


class _Gauge:
    def __init__(self) -> None:
        self.value: float | None = None

    def set(self, value: float) -> None:
        self.value = value


def test_pool_picks_least_outstanding_with_round_robin_ties():
    gauges = [_Gauge() for _ in range(3)]
    pool = BackendPool([Backend("decode", f"http://d{i}:1", g) for i, g in enumerate(gauges)])
    assert [g.value for g in gauges] == [0, 0, 0]
    leases = [pool.acquire() for _ in range(3)]  # all tied: one each, in turn
    assert [lease.backend.url for lease in leases] == ["http://d0:1", "http://d1:1", "http://d2:1"]
    leases[1].release()
    leases[1].release()  # idempotent: counted once
    assert [b.outstanding for b in pool.backends] == [1, 0, 1]
    assert gauges[1].value == 0 and gauges[0].value == 1
    again = pool.acquire()  # d1 is the only one with the fewest
    assert again.backend.url == "http://d1:1" and gauges[1].value == 1
    with pytest.raises(ValueError, match="at least one backend"):
        BackendPool([])


def test_pool_leaves_out_a_backend_that_cannot_be_connected_to():
    now = [100.0]
    pool = BackendPool([Backend("decode", f"http://d{i}:1", _Gauge()) for i in range(3)],
                       clock=lambda: now[0])
    d0, d1, d2 = pool.backends
    assert d0.unreachable(now[0]) == 1.0  # down for 1 s, doubling per failure in a row
    picks = {pool.acquire().backend.url for _ in range(6)}
    assert picks == {"http://d1:1", "http://d2:1"}  # d0 has the fewest outstanding, but is down
    now[0] += 1.0
    assert d0.up(now[0]) and pool.acquire().backend is d0  # back: the fewest outstanding
    assert d0.unreachable(now[0]) == 2.0  # failed again once back: doubled
    # legs that were sent before it went out fail while it is out: no longer
    assert d0.unreachable(now[0] + 0.5) == 1.5 and d0.connect_failures == 3
    for _ in range(10):  # each back-off runs out, and the next try fails
        now[0] = d0.down_until
        d0.unreachable(now[0])
    assert d0.down_until - now[0] == 30.0  # capped
    for _ in range(2000):  # a backend down for hours: 2 ** 1024 would overflow a float
        now[0] = d0.down_until
        assert d0.unreachable(now[0]) == 30.0
    assert d0.reachable() and d0.connect_failures == 0 and d0.up(now[0])
    assert not d0.reachable()  # was not failing
    # preferences: up and not avoided, then up, then the one due back first; never excluded
    d1.unreachable(now[0])
    assert pool.acquire(avoid={"http://d0:1", "http://d2:1"}).backend in (d0, d2)
    assert pool.acquire(exclude={"http://d0:1", "http://d2:1"}).backend is d1  # down, but left
    assert pool.acquire(exclude={"http://d0:1", "http://d1:1", "http://d2:1"}) is None
    for b in (d0, d2):
        b.unreachable(now[0])
    assert pool.acquire().backend is d1  # all down: d1 is due back first (1 s, the others 1-2 s)


async def test_a_dead_decode_server_is_left_out_and_its_legs_go_to_another():
    """One of two decode servers is dead (nothing listens): it used to win nearly every pick
    (it fails at once, so it always has the fewest outstanding legs). Now a leg that cannot
    connect to it goes to the other D (nothing had been sent), and it is left out of selection
    for a while."""
    async with cluster(dead_decodes=1) as c:
        (d,) = c.decodes
        results = await asyncio.gather(*(post(c, "/v1/completions", dict(COMPLETION, stream=s))
                                          for s in (False, True) * 10))
        assert [status for status, _, _ in results] == [200] * 20
        assert len(d.records) == 20
        m = await c.metrics()
        assert m[("kv_push_router_leg_retries_total", (("leg", "decode"),))] >= 1
        assert m[("kv_push_router_backend_ejections_total", (("role", "decode"),))] >= 1
        h = (await c.client.get("/health")).json()
        dead = h["decode"][0]
        assert h["status"] == "degraded" and dead["down_for_s"] > 0, h
        assert "down_for_s" not in h["decode"][1]
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_health_is_503_while_every_decode_server_is_left_out(caplog):
    """A readiness check on plain /health must not keep sending traffic to a router that can
    serve nothing (its only D cannot be connected to)."""
    async with cluster(dead_decodes=1, n_d=0) as c:
        assert (await c.client.get("/health")).status_code == 200  # not known to be down yet
        with caplog.at_level("WARNING", logger="kv_push.router"):
            for _ in range(3):
                r = await c.client.post("/v1/completions", json=COMPLETION)
                assert r.status_code == 502, r.text
        # each request tries the only D: said once a minute, not twice per request (a
        # walkthrough counted 449 such lines in a few minutes)
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert sum("cannot be connected to" in m for m in said) == 1, said
        assert sum("decode leg failed (connect)" in m for m in said) == 1, said
        h = await c.client.get("/health")
        assert h.status_code == 503 and h.json()["decode"][0]["down_for_s"] > 0, h.json()
        # three failed tries, one ejection: the 2nd and 3rd probed a D already out (a
        # walkthrough saw the counter equal every connect failure: useless for alerting)
        m = await c.metrics()
        assert m[("kv_push_router_backend_ejections_total", (("role", "decode"),))] == 1
        await eventually(lambda: all_idle(c), "router to be idle")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_dead_prefill_server_costs_no_request_while_another_is_up(stream: bool, caplog,
                                                                          monkeypatch):
    """One of two P's is dead (nothing listens). A request that picks it cannot connect its P
    leg: D's leg, which would name that P's side channel and wait for a prefill nobody makes,
    is not sent yet (it goes out once P's connection is made), so the request moves to the
    other P -- no 502 (until 2026-12-06 the first request, and one more at each end of the dead
    P's ejection, failed). The dead P is left out of selection and never gets a Release."""
    from kv_push.common.router import pool

    monkeypatch.setattr(pool, "EJECT_BASE_S", 60.0)  # (1 s ran out on a loaded box: a 2nd try)
    async with cluster(dead_prefills=1) as c:
        body = dict(COMPLETION, stream=stream)
        with caplog.at_level("WARNING"):
            first = [await post(c, "/v1/completions", body) for _ in range(2)]
        assert [s for s, _, _ in first] == [200, 200]  # round robin: the dead P picked once
        said = [r.getMessage() for r in caplog.records]
        assert sum("prefill leg: cannot connect to" in m for m in said) == 1, said
        later = await asyncio.gather(*(post(c, "/v1/completions", body) for _ in range(8)))
        assert [s for s, _, _ in later] == [200] * 8
        (p,), (d,) = c.prefills, c.decodes
        assert len(p.records) == 10 and len(d.records) == 10
        # every D leg names the live P's side channel, none the dead one's
        assert {r.body["kv_transfer_params"]["remote_port"] for r in d.records} == {p.kv_port}
        await eventually(lambda: all_idle(c), "router to be idle")
        await eventually(lambda: not c.router.releaser.busy(), "releaser idle")
        m = await c.metrics()
        assert m[("kv_push_router_leg_retries_total", (("leg", "prefill"),))] == 1
        assert m[("kv_push_router_upstream_errors_total",
                  (("kind", "connect"), ("leg", "prefill")))] == 1
        assert m[("kv_push_router_backend_ejections_total", (("role", "prefill"),))] == 1
        # the dead P never had the request: no Release goes to its side channel (a
        # walkthrough saw one fail against it, counted and logged as a failure)
        assert not [k for k in m if k[0] == "kv_push_router_releases_total" and m[k]], m
        # the failed leg's error was read: asyncio logs no "Task exception was never
        # retrieved" ERROR (with a traceback) for a request that was served
        gc.collect()
        await asyncio.sleep(0)
        assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]


async def test_a_prefill_leg_failing_before_its_headers_went_out_sends_decode_nothing(
        monkeypatch):
    """P's leg failed before a byte of it was written, and not by a refused connection (a
    pooled connection reset, a proxy refusing CONNECT): P has nothing, so D must get no leg
    that would wait for P's prefill (a cold review saw D get one)."""
    real = Router._post_leg

    async def post_leg(self, backend, endpoint, body, headers, sent=None, *args, **kwargs):
        if sent is not None:  # the P leg
            raise aiohttp.ClientOSError(104, "Connection reset by peer")
        return await real(self, backend, endpoint, body, headers, sent, *args, **kwargs)

    monkeypatch.setattr(Router, "_post_leg", post_leg)
    async with cluster() as c:
        status, data, _ = await post(c, "/v1/completions", COMPLETION)
        assert status == 502 and b"prefill server failed" in data, data
        await eventually(lambda: all_idle(c), "router to be idle")
        assert c.decodes[0].records == []


async def test_an_exchange_whose_close_fails_midway_still_gives_its_slots_back(monkeypatch):
    """Closing D's response inside an exchange's close raised (or the close was cancelled
    there): the legs' slots were kept for good (a backend's outstanding count inflated, and
    least-outstanding selection skewed) and the request was not counted."""
    from kv_push.common.router import app as app_module

    real = app_module.DecodeStream.aclose

    async def aclose(self):
        await real(self)
        if sys._getframe(1).f_code.co_name == "close":  # Exchange.close's call only
            raise RuntimeError("closing failed")

    monkeypatch.setattr(app_module.DecodeStream, "aclose", aclose)
    async with cluster() as c:
        await post(c, "/v1/completions", COMPLETION)
        backends = c.router.prefill_pool.backends + c.router.decode_pool.backends
        await eventually(lambda: all(b.outstanding == 0 for b in backends),
                         "every slot given back")
        m = await c.metrics()
        assert sum(v for k, v in m.items() if k[0] == "kv_push_router_requests_total") == 1


async def test_with_every_prefill_server_dead_decode_gets_no_leg():
    """No P can be connected to: the client's 502 comes at once, and D never gets a leg that
    would wait for a prefill nobody makes (before 2026-12-06 D got it, and failed it only when
    its own dial to P's side channel failed)."""
    async with cluster(dead_prefills=1, n_p=0) as c:
        for stream in (False, True):
            r = await c.client.post("/v1/completions", json=dict(COMPLETION, stream=stream))
            assert r.status_code == 502, r.text
            assert "cannot connect to the prefill server" in r.text, r.text
        assert c.decodes[0].records == []
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_requests_are_steered_away_from_a_pair_known_to_be_incompatible(monkeypatch):
    async with cluster(n_d=2) as c:
        bad, good = c.decodes
        bad.behavior.fail_status = 500
        bad.behavior.metrics_text = _refusal_metrics(f"127.0.0.1:{KV_BASE_PORT}", REFUSAL)
        statuses = [(await post(c, "/v1/completions", COMPLETION))[0] for _ in range(2)]
        assert sorted(statuses) == [200, 500]  # round robin: the bad pair once
        later = await asyncio.gather(*(post(c, "/v1/completions", COMPLETION)
                                       for _ in range(8)))
        assert [s for s, _, _ in later] == [200] * 8 and len(bad.records) == 1
        # a while later the pair is tried again (a side may have been reconfigured)
        bad.behavior.fail_status = None
        clock = c.router.compat.clock
        monkeypatch.setattr(c.router.compat, "clock", lambda: clock() + 31)
        more = [await post(c, "/v1/completions", COMPLETION) for _ in range(4)]
        assert [s for s, _, _ in more] == [200] * 4 and len(bad.records) > 1
        assert c.router.compat.incompatible == {}  # it worked: history


def test_module_entry_point_is_the_command_line(tmp_path):
    """``python -m kv_push.common.router`` (used by scripts and tests) is the CLI."""
    # cwd elsewhere: the repository root's kv_push/ must not shadow the package under test.
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    out = run([sys.executable, "-m", "kv_push.common.router", "--help"])
    assert out.returncode == 0 and "upstream-push" in out.stdout, out.stderr
    out = run([sys.executable, "-m", "kv_push.common.router", "--prefill", "http://p:1",
               "--decode", "http://d:2"])
    assert out.returncode == 2 and "kv=HOST:PORT" in out.stderr, out.stderr
    # an unreadable secret file: one line, like the command line's errors, no traceback
    env = {k: v for k, v in os.environ.items() if not k.startswith("KV_PUSH_SECRET")}
    out = run([sys.executable, "-m", "kv_push.common.router", "--prefill",
               "http://p:1,kv=p:2", "--decode", "http://d:2"],
              env=dict(env, KV_PUSH_SECRET_FILE=str(tmp_path / "missing")))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        "kv-push-router: error: cannot read the secret file")


# -- what clients are told (OpenAI errors, no internal addresses) --------------------------------

VLLM_400 = {"error": {"message": "max_tokens=5000 cannot be greater than the remaining context "
                                 "(2048 tokens)", "type": "BadRequestError",
                      "param": "max_tokens", "code": 400}}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_4xx_with_an_openai_body_reaches_the_client_as_vllm_wrote_it(stream: bool):
    async with cluster() as c:
        d = c.decodes[0]
        d.behavior.fail_status, d.behavior.error_body = 400, VLLM_400
        r = await c.client.post("/v1/completions", json=dict(COMPLETION, stream=stream,
                                                             max_tokens=5000))
        assert r.status_code == 400 and r.json() == VLLM_400  # status, message, type, param, code
        assert r.headers["x-request-id"]
        m = await c.metrics()
        assert m[("kv_push_router_upstream_errors_total",
                  (("kind", "http_4xx"), ("leg", "decode")))] == 1
        # the client's mistake, not a decode failure (dashboards read the outcome)
        outcomes = {dict(k[1])["outcome"]: v for k, v in m.items()
                    if k[0] == "kv_push_router_requests_total" and v}
        assert outcomes == {"rejected": 1}, outcomes
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_when_both_legs_reject_a_request_the_client_gets_decodes_answer():
    """P answers first (its leg is smaller), but the client's answer is D's: D has the
    client's own body, as a single server would."""
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        p.behavior.fail_status = 400
        p.behavior.error_body = {"error": {"message": "P says no", "type": "BadRequestError",
                                           "param": None, "code": 400}}
        d.behavior.fail_status, d.behavior.error_body = 400, VLLM_400
        d.behavior.delay = 0.2
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 400 and r.json() == VLLM_400
        m = await c.metrics()  # both rejected it: not a P/D disagreement
        assert not any(k[0] == "kv_push_router_prefill_rejected_alone_total" and v
                       for k, v in m.items())
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_p_and_d_with_different_context_lengths_are_named_at_start(caplog):
    """The router reads each backend's /v1/models at start-up: a P whose max_model_len is
    smaller than D's is logged (WARNING, once) and listed in /health; a pair that agrees is
    not."""
    def lengths(prefills, decodes):
        prefills[0].behavior.max_model_len = 512

    with caplog.at_level(logging.WARNING, logger="kv_push.router"):
        async with cluster(n_p=2, before_start=lengths) as c:
            await eventually(lambda: bool(c.router.limit_mismatches), "the start-up reading")
            p_urls = [b.url for b in c.router.prefill_pool.backends]
            d_url = c.router.decode_pool.backends[0].url
            assert c.router.limit_mismatches == [{
                "prefill": p_urls[0], "decode": d_url, "model": "fake-model",
                "prefill_max_model_len": 512, "decode_max_model_len": 1024}]
            health = (await c.client.get("/health")).json()
            assert health["limit_mismatches"] == c.router.limit_mismatches
            r = await c.client.post("/v1/completions", json=COMPLETION)
            assert r.status_code == 200  # a warning, not a refusal
    said = [rec.getMessage() for rec in caplog.records if "max_model_len 512" in rec.getMessage()]
    assert len(said) == 1 and p_urls[0] in said[0] and "prompts of 512-1023 tokens" in said[0]


async def test_a_4xx_from_prefill_alone_is_the_clients_if_decode_never_answers(caplog):
    """P rejects what D accepts (a walkthrough: P started with --max-model-len 512, D with
    1024, a 600-token prompt): the client gets P's error after the grace; the router counts it
    and says, once a minute per pair, that P and D may differ in their limits."""
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        p_err = {"error": {"message": "P says no", "type": "BadRequestError", "param": "x",
                           "code": 422}}
        p.behavior.fail_status, p.behavior.error_body = 422, p_err
        d.behavior.delay = 30.0  # D waits for KV that never comes
        with caplog.at_level(logging.WARNING, logger="kv_push.router"):
            for _ in range(2):
                r = await c.client.post("/v1/completions", json=COMPLETION)
                assert r.status_code == 422 and r.json() == p_err
        await eventually(lambda: len(d.records) == 2 and all(x.disconnected for x in d.records),
                         "D legs to be cancelled")
        m = await c.metrics()
        p_url = c.router.prefill_pool.backends[0].url
        d_url = c.router.decode_pool.backends[0].url
        assert m[("kv_push_router_prefill_rejected_alone_total", (("backend", p_url),))] == 2
        said = [rec.getMessage() for rec in caplog.records if "did not" in rec.getMessage()]
        assert len(said) == 1 and p_url in said[0] and d_url in said[0], said
        assert "returned HTTP 422: P says no)" in said[0] and "--max-model-len" in said[0]
        assert said[0].count("HTTP 422") == 1
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_error_messages_name_the_leg_not_its_address():
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        p.behavior.fail_status, d.behavior.delay = 500, 5.0
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 500
        assert r.json()["error"] == {"message": "the prefill server returned HTTP 500: p0 failed",
                                     "type": "prefill_error", "code": 500}
        p.behavior.error_body = {"error": {"message": "KV store at 10.2.3.4:7000 is gone",
                                           "type": "InternalServerError", "code": 500}}
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.json()["error"]["message"] == (
            "the prefill server returned HTTP 500: KV store at <address> is gone")
        p.behavior.fail_status, d.behavior.delay, d.behavior.n_chunks = None, 0.0, 0
        r = await c.client.post("/v1/completions", json=dict(COMPLETION, stream=True))
        assert r.status_code == 502 and "127.0.0.1" not in r.text and "http:" not in r.text
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_a_secret_on_prefill_only_is_reported_to_the_client_and_health():
    """P has KV_PUSH_SECRET, D has not: D refuses P's Challenge and counts it like a refusal
    by P (``handshake_refusals``, the label the decoder makes: test_side_channel's
    test_a_refusal_decided_by_the_decoder_is_counted_like_one_by_the_producer). The client
    learns what differs (not where), /health which pair."""
    reason = (f"secret_mismatch: the producer at 127.0.0.1:{KV_BASE_PORT} uses a shared secret "
              "but this decoder has none: set KV_PUSH_SECRET (or secret_file) on both sides or "
              "neither")
    async with cluster() as c:
        d = c.decodes[0]
        d.behavior.fail_status = 500  # vLLM: "Internal server error"
        d.behavior.metrics_text = _refusal_metrics(f"127.0.0.1:{KV_BASE_PORT}", reason)
        r = await c.client.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "incompatible_peers"
        assert reason.replace(f"127.0.0.1:{KV_BASE_PORT}", "<address>") in err["message"]
        assert "127.0.0.1" not in err["message"]
        h = await c.client.get("/health", params={"probe": "1"})
        assert h.status_code == 503
        (inc,) = h.json()["incompatible"]
        assert inc["reason"] == reason and inc["kv"] == f"127.0.0.1:{KV_BASE_PORT}"
        await eventually(lambda: all_idle(c), "router to be idle")


def test_a_refusal_told_to_clients_carries_no_address():
    from kv_push.common.router.compat import Incompatibility
    inc = Incompatibility("http://10.1.2.3:8100", "10.1.2.3:5600", "http://d.svc:8200",
                          "unauthenticated: the decoder at 10.9.8.7:41234 has no shared secret; "
                          "producer at [fe80::1]:5601, p-0.prefill.svc:5600, localhost:1")
    text = inc.client_message()
    assert "no shared secret" in text and "unauthenticated" in text
    for leak in ("10.", "fe80", "svc", "localhost", "8100", "8200"):
        assert leak not in text, (leak, text)
    assert "10.1.2.3:5600" in inc.message()  # the operator's log keeps them


# -- fanout: P prefills once for n samples -------------------------------------------------------


async def test_n_samples_are_one_prefill_with_fanout(monkeypatch):
    from kv_push.common.connector_scheduler import MAX_FANOUT, TransferParams

    from kv_push.common.router import app as router_app

    assert router_app.MAX_FANOUT == MAX_FANOUT
    monkeypatch.setenv("KV_PUSH_SECRET", "router-secret")
    monkeypatch.delenv("KV_PUSH_SECRET_FILE", raising=False)
    async with cluster() as c:
        (p,), (d,) = c.prefills, c.decodes
        status, _, headers = await post(c, "/v1/completions", dict(COMPLETION, n=3, seed=7))
        assert status == 200
        await eventually(lambda: bool(p.records) and p.records[0].completed, "P leg")
        (prec,), (drec,) = p.records, d.records
        assert prec.body["n"] == 1 and drec.body["n"] == 3 and drec.body["seed"] == 7
        pp = TransferParams.parse(prec.kv, b"router-secret")  # fanout is signed
        assert (pp.transfer_id, pp.do_remote_decode, pp.fanout) == (
            headers["x-request-id"], True, 3)
        assert TransferParams.parse(drec.kv, b"router-secret").fanout == 1
        with pytest.raises(ValueError):  # a changed fanout breaks the signature
            TransferParams.parse(dict(prec.kv, fanout=2), b"router-secret")
        # n=1 goes as it is (beam search, where n is the beam width, goes to D alone:
        # test_beam_search_goes_to_d_alone)
        assert (await post(c, "/v1/completions", dict(COMPLETION, n=1)))[0] == 200
        await eventually(lambda: len(p.records) == 2 and p.records[-1].completed, "P legs")
        assert p.records[1].body.get("n") == 1 and "fanout" not in p.records[1].kv
        await eventually(lambda: all_idle(c), "router to be idle")


class RecordingProxy:
    """A plain-HTTP forward proxy on loopback: takes absolute-form requests
    (``POST http://host:port/path``), records their URLs, and relays each connection to its
    target byte for byte (one request per connection: it closes after the first exchange's
    bytes, and a relay that fails closes the client's connection, so a leg never hangs)."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.server: asyncio.AbstractServer | None = None
        self.writers: set[asyncio.StreamWriter] = set()  # open client and upstream connections

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.close()
        await self.server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, url, rest = head.split(b" ", 2)
            self.urls.append(url.decode())
            target = httpx.URL(url.decode())
            up_r, up_w = await asyncio.open_connection(target.host, target.port)
            self.writers.add(up_w)
            # origin-form, and no keep-alive: a second request on this connection would reach
            # the backend unrecorded
            up_w.write(b" ".join((method, target.raw_path, rest.replace(
                b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))))

            async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
                with contextlib.suppress(ConnectionError):
                    while data := await src.read(65536):
                        dst.write(data)
                        await dst.drain()
                dst.close()

            await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        finally:
            writer.close()


def test_leg_proxy_follows_the_proxy_variables(monkeypatch):
    """Which proxy a backend's legs use (Router.start looks each one up once)."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    assert leg_proxy("http://10.0.0.5:8100") is None
    monkeypatch.setenv("http_proxy", "u:secret@proxy.example:3128")  # no scheme: http://
    monkeypatch.setenv("https_proxy", "https://proxy.example:3129")
    monkeypatch.setenv("all_proxy", "socks5://proxy.example:1080")  # not for the legs
    assert leg_proxy("http://10.0.0.5:8100") == "http://u:secret@proxy.example:3128"
    assert leg_proxy("https://p.internal:8100") == "https://proxy.example:3129"
    assert redacted(leg_proxy("http://10.0.0.5:8100") or "") == "http://proxy.example:3128"
    monkeypatch.setenv("no_proxy", "internal,10.0.0.5")
    assert leg_proxy("http://10.0.0.5:8100") is None
    assert leg_proxy("https://p.internal:8100") is None
    assert leg_proxy("http://10.0.0.6:8100") == "http://u:secret@proxy.example:3128"
    monkeypatch.setenv("http_proxy", "socks5://u:secret@proxy.example:1080")
    with pytest.raises(ValueError, match="HTTP and HTTPS proxies only") as err:
        leg_proxy("http://10.0.0.6:8100")
    assert "secret" not in str(err.value)


@pytest.mark.parametrize("no_proxy", [False, True])
async def test_the_legs_honour_the_proxy_variables(monkeypatch, no_proxy: bool):
    """Proxy variables are read once, at start (aiohttp's trust_env reread them and ~/.netrc in
    threads for every leg): with ``http_proxy`` both legs go through the proxy, with
    ``no_proxy`` naming the backends' host neither does."""
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    proxy = RecordingProxy()
    async with proxy as proxy_url:
        monkeypatch.setenv("http_proxy", proxy_url)
        if no_proxy:
            monkeypatch.setenv("no_proxy", "127.0.0.1")
        async with cluster() as c:
            (p,), (d,) = c.prefills, c.decodes
            backends = c.router.prefill_pool.backends + c.router.decode_pool.backends
            status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, stream=True))
            assert status == 200 and data == d.records[0].sent
            await eventually(lambda: all_idle(c), "router to be idle")
            if no_proxy:
                assert proxy.urls == [] and all(b.proxy is None for b in backends)
            else:
                p_url = c.router.prefill_pool.backends[0].url
                d_url = c.router.decode_pool.backends[0].url
                # (the router's start-up reads, of D's refusals and of every backend's
                # context length, go the same way)
                legs = [u for u in proxy.urls if not u.endswith(("/metrics", "/v1/models"))]
                assert sorted(legs) == sorted([p_url + "/v1/completions",
                                               d_url + "/v1/completions"])
                assert {p_url + "/v1/models", d_url + "/v1/models"} <= set(proxy.urls)
                assert all(b.proxy == proxy_url for b in backends)
