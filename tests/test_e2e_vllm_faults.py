"""End to end on real vLLM (CPU build), the heavier cases: each class starts its own servers.

* ``TestIncompatiblePeers`` -- P with 64-token blocks, D with 128 (the CPU default): vLLM's CPU
  blocks are opaque, so D's handshake is refused. The client's error names the reason (the router
  reads it from D's ``/metrics``; vLLM itself answers only "Internal server error"), D logs it
  once for the pair, ``/health?probe=true`` lists the pair; with ``kv_load_failure_policy =
  recompute`` the request is served by local prefill and ``load_failures{recompute}`` counts it.
* ``TestKillMidStream`` -- kill -9 of P, then of D, with streams in flight: every request ends
  (served, or failed with an error), none hangs; the survivor holds no request and no KV block,
  and keeps serving. Between the two, through a router over both P's, the dead P costs no
  request (its P legs move to the live P before D's leg goes out; D never dials it).
* ``TestReleaseOnHangUp`` -- the router's ``Release`` (P's ``rendezvous_ttl_s`` 120 s here): a
  storm of clients that hang up before D's first byte -- through a decode "server" that accepts
  and never answers (D's engine never sees any request, so only the router can make P let go),
  then through a real D with early hang-ups -- leaves P (and D) with no KV block in use within
  seconds, before the TTL could have freed anything, each prefill freed by a release.
* ``TestFrozenProducer`` -- P stopped with SIGSTOP right before requests D registers with it:
  their clients get an error once P is unresponsive (seconds), not after the fence's bound,
  while D keeps their blocks until P, resumed, answers the cancels; both idle afterwards.
* ``TestChunkedProducer`` -- P prefills every prompt in chunks (``--max-num-batched-tokens``
  below each prompt's length), D does not: outputs identical to a single server, D computes no
  prompt token, and a seeded sampling request (which kills vLLM 0.32's CPU engine when it
  prefills the prompt in chunks) is served twice alike with P alive: the router's P leg carries
  no seed. A client sending both legs itself hangs up P's while P's engine is mid-prefill and D
  waits: both count ``transfers_abandoned{prefill_aborted}`` (not a failure) and D's request
  ends at once.
* ``TestTensorParallel2`` -- P and D both at TP 2 (vLLM's CPU build runs TP over gloo): outputs
  identical to a single server at TP 2. Needs 4 cores: skipped on fewer (``KV_PUSH_E2E_TP2=1``
  runs it anyway). On this 2-core box it fits in memory (4.8 + 4.8 GiB resident for P and D)
  but it never passed (five runs): at the first P/D request the workers' transfer threads stall
  for 45-60 s -- a handshake to producer rank 1 timed out after 60 s waiting for its first frame,
  the producer's inbox reported 61 s of queue wait, a call onto a decoder rank's transfer thread
  timed out while the producer saw that rank silent for 45 s -- so the KV does not arrive within
  the decoder's 60 s. TP 1 never shows this. Whether it is four TP workers starving two cores or
  NIXL calls that block while ranks connect to each other is not settled (gdb could not attach
  within 120 s on the loaded box).

They run on the first vLLM environment only (``KV_PUSH_E2E_HEAVY=all``: every one), so that
``make test``, which runs two versions, stays short.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kv_push.common.messages import ABANDONED
from kv_push.common.server_watch import title_of
from kv_push.common.testing.vllm_servers import Server, free_port, metric, router, vllm_server
from kv_push.common.worker import STATE_LOG_ENV

try:
    from conftest import bindable, free_port_pair
    from e2e_support import (MAX_TOKENS, NUM_PROMPTS, REQUEST_BOUND_S, References, body,
                             assert_idle, busy, complete, heavy_venvs, make_prompts, signature,
                             tiny_model_path)
except ModuleNotFoundError:  # imported as a package module
    from tests.conftest import bindable, free_port_pair
    from tests.e2e_support import (MAX_TOKENS, NUM_PROMPTS, REQUEST_BOUND_S, References, body,
                                   assert_idle, busy, complete, heavy_venvs, make_prompts,
                                   signature, tiny_model_path)

pytestmark = pytest.mark.e2e

TTL = 15  # producers' rendezvous_ttl_s: an unpaired prefill is freed within this
IDLE_BOUND = TTL + 30  # a survivor must be idle within this after a fault


@pytest.fixture(scope="module")
def model():
    return tiny_model_path()


@pytest.fixture(scope="module")
def prompts(model) -> list[str]:
    return make_prompts(model)


@pytest.fixture(scope="module", params=heavy_venvs(), ids=lambda v: f"vllm-{v[0]}")
def env(request, model, prompts, tmp_path_factory):
    version, python = request.param
    if not Path(python).exists():
        pytest.fail(f"vLLM {version} environment {python} is missing: run `make test`")
    logs = tmp_path_factory.mktemp(f"faults-{version}")
    return {"version": version, "python": python, "logs": logs, "model": str(model),
            "reference": References.get(version, python, model, prompts, logs)}


def start(env, name: str, cpu, **kw) -> Server:
    # workers log what they hold every 5 s while they hold anything (diagnostics)
    return vllm_server(name, python=env["python"], model=env["model"], port=free_port(), cpu=cpu,
                       log_dir=env["logs"], extra_env={STATE_LOG_ENV: "5"}, **kw)


def producer(env, name: str, cpu=0, tp: int = 1, extra_config: dict | None = None,
             **kw) -> tuple[Server, int]:
    kv_port = free_port_pair(tp)  # rank r listens on kv_port + r
    return start(env, name, cpu, kv_role="kv_producer", kv_port=kv_port, tp=tp,
                 extra_config={"rendezvous_ttl_s": TTL, **(extra_config or {})}, **kw), kv_port


def decoder(env, name: str, cpu=1, **kw) -> Server:
    return start(env, name, cpu, kv_role="kv_consumer", kv_port=free_port(), **kw)


def up(servers: list[Server]) -> None:
    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(lambda s: s.wait_healthy(), servers))


def front(env, name: str, p: Server, kv_port: int, d: Server) -> Server:
    r = router(python=env["python"], port=free_port(), prefill=[(p.url, kv_port)], decode=[d.url],
               log_dir=env["logs"], name=name)
    r.wait_healthy(60)
    return r


def stop(servers: list[Server]) -> None:
    for s in reversed(servers):
        s.stop()


# -- incompatible peers ----------------------------------------------------------------------


class TestIncompatiblePeers:
    @pytest.fixture(scope="class")
    def pair(self, env):
        servers = []
        try:
            p, kv = producer(env, "prefill-bs64", block_size=64)
            servers.append(p)
            d_fail = decoder(env, "decode-fail")
            servers.append(d_fail)
            d_rec = decoder(env, "decode-recompute",
                            kv_config={"kv_load_failure_policy": "recompute"})
            servers.append(d_rec)
            up(servers)
            servers.append(r_fail := front(env, "router-fail", p, kv, d_fail))
            servers.append(r_rec := front(env, "router-recompute", p, kv, d_rec))
            yield {"p": p, "d_fail": d_fail, "d_rec": d_rec, "r_fail": r_fail, "r_rec": r_rec}
        finally:
            stop(servers)

    def test_reason_reaches_client_and_operator_once(self, pair, prompts, figures):
        url = pair["r_fail"].url
        errors, t0 = [], time.monotonic()
        for i, stream in enumerate((False, False, False, True)):
            r = httpx.post(f"{url}/v1/completions", timeout=REQUEST_BOUND_S,
                           json=body(prompts[10 + i], stream=stream))
            assert r.status_code == 500, r.text
            errors.append(r.json()["error"])
        # a chat stream: vLLM sends its role chunk before the failure; the client still gets
        # the reason as an HTTP error (router/sse.py), and the pair stays listed (below)
        chat = {"model": "tiny", "max_tokens": 8, "temperature": 0.5, "stream": True,
                "messages": [{"role": "user", "content": prompts[14]}]}
        r = httpx.post(f"{url}/v1/chat/completions", timeout=REQUEST_BOUND_S, json=chat)
        assert r.status_code == 500, r.text
        errors.append(r.json()["error"])
        figures("e2e faults", "incompatible pair: 5 requests refused", time.monotonic() - t0,
                errors[0]["message"][-90:])
        for err in errors:
            assert err["type"] == "incompatible_peers", err
            assert "block_size: 64 on the producer, 128 on the decoder" in err["message"], err
        d, p = pair["d_fail"], pair["p"]
        assert metric(d.url, "vllm:kv_push_load_failures_total", reason="fail") >= 4
        assert metric(d.url, "vllm:kv_push_handshake_refusals_total") >= 4
        # the operator reads the reason once per pair, not once per request (vLLM 0.29's server
        # log shows none of the connector's warnings: there only "not more than once" holds)
        d_log, p_log = d.log_text(), p.log_text()
        once = 1 if "kv_push: " in d_log else 0  # any connector warning shown at all
        assert d_log.count("and this decoder are incompatible") == once, d_log[-3000:]
        assert d_log.count("failed (kv_load_failure_policy=fail)") == once, d_log[-3000:]
        assert p_log.count("opaque block layouts need equal block_size") <= 1, p_log[-3000:]
        h = httpx.get(f"{url}/health", params={"probe": "true"}, timeout=30)
        assert h.status_code == 503, h.text
        (inc,) = h.json()["incompatible"]
        assert "block_size" in inc["reason"] and inc["decode"] == d.url
        # the probe dialled P's side channel too: P is up, and counted a probe, not a failure
        assert all(b["healthy"] for b in h.json()["prefill"]), h.json()
        # (worker counters reach /metrics with an engine step: one plain request to P)
        httpx.post(f"{p.url}/v1/completions", json=body(prompts[15], max_tokens=1),
                   timeout=REQUEST_BOUND_S).raise_for_status()
        deadline = time.monotonic() + 10
        while metric(p.url, "vllm:kv_push_side_channel_probes_total") < 1 \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric(p.url, "vllm:kv_push_side_channel_probes_total") >= 1
        assert metric(p.url, "vllm:kv_push_rejected_total", reason="handshake_io") == 0
        assert_idle([d], within=IDLE_BOUND)

    def test_a_wrong_kv_port_on_the_router_is_named(self, pair, prompts, env, figures):
        """A router given a ``kv=`` where nothing listens: D's handshake fails (no refusal to
        read), the router finds P's side channel unreachable itself and says so to the client,
        and its health probe names it; D is left idle."""
        d = pair["d_fail"]
        bad = router(python=env["python"], port=free_port(), prefill=[(pair["p"].url, free_port())],
                     decode=[d.url], log_dir=env["logs"], name="router-wrong-kv")
        try:
            bad.wait_healthy(60)
            t0 = time.monotonic()
            r = httpx.post(f"{bad.url}/v1/completions", timeout=REQUEST_BOUND_S,
                           json=body(prompts[16]))
            figures("e2e faults", "wrong kv= port: request answered", time.monotonic() - t0,
                    r.json().get("error", {}).get("type", ""))
            assert r.status_code == 502, r.text
            err = r.json()["error"]
            assert err["type"] == "kv_side_channel_unreachable", err
            assert "Connection refused" in err["message"], err
            h = httpx.get(f"{bad.url}/health", params={"probe": "true"}, timeout=30)
            assert h.status_code == 503, h.text
            (pe,) = h.json()["prefill"]
            assert not pe["healthy"] and "Connection refused" in pe["error"], pe
        finally:
            bad.stop()
        assert_idle([d], within=IDLE_BOUND)

    def test_recompute_policy_serves_by_local_prefill(self, pair, prompts, env):
        d = pair["d_rec"]
        local0 = metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_compute")
        prompt = prompts[9]
        choice = complete(pair["r_rec"].url, prompt, timeout=REQUEST_BOUND_S)["choices"][0]
        assert signature(choice) == env["reference"][prompt]
        assert metric(d.url, "vllm:kv_push_load_failures_total", reason="recompute") >= 1
        local = metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_compute")
        assert local - local0 >= 130, (local0, local)  # the whole prompt (130+ tokens) here
        assert metric(d.url, "vllm:prompt_tokens_by_source_total",
                      source="external_kv_transfer") == 0


# -- kill -9 mid-stream ------------------------------------------------------------------------


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                  started: asyncio.Event) -> dict:
    """One streamed completion; what the client saw."""
    out = {"status": None, "text": "", "done": False, "error": None}
    t0 = time.monotonic()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True}) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                out["error"] = r.text[:300]
            else:
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: "):
                        data = json.loads(line[6:])
                        if "error" in data:
                            out["error"] = str(data["error"])[:300]
                        else:
                            out["text"] += data["choices"][0]["text"]
                            started.set()
    except httpx.HTTPError as e:
        out["error"] = f"client: {e!r}"
    out["elapsed"] = time.monotonic() - t0
    return out


def _traffic_with_kill(url: str, prompts: list[str], victim: Server, max_tokens: int,
                       count: int = 8) -> tuple[list[dict], int]:
    """Send ``count`` streams, a little apart; kill -9 ``victim`` as soon as the first one has
    produced output (so others are mid-stream or still waiting for their KV). Every request
    must end within ``REQUEST_BOUND_S``. Returns (results, requests in flight at the kill)."""
    async def run():
        started = asyncio.Event()
        async with httpx.AsyncClient(timeout=REQUEST_BOUND_S) as client:
            tasks = []
            for i in range(count):
                tasks.append(asyncio.ensure_future(
                    _stream(client, url, prompts[12 + i % 8], max_tokens, started)))
                await asyncio.sleep(0.05)
            await asyncio.wait_for(started.wait(), REQUEST_BOUND_S)
            in_flight = sum(not t.done() for t in tasks)
            await asyncio.get_running_loop().run_in_executor(None, victim.kill9)
            results = await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_BOUND_S + 5)
            return list(results), in_flight
    return asyncio.run(run())


def _summary(results: list[dict]) -> str:
    ok = sum(r["done"] and not r["error"] for r in results)
    return f"{ok} served, {len(results) - ok} failed: " + "; ".join(
        sorted({str(r["error"])[:60] for r in results if r["error"]}))[:200]


class TestKillMidStream:
    @pytest.fixture(scope="class")
    def trio(self, env, prompts):
        servers = []
        try:
            # room for long streams: the tiny model decodes a few ms per token, and D must die
            # under streams still running
            p1, kv1 = producer(env, "prefill-1", max_model_len=2048)
            p2, kv2 = producer(env, "prefill-2", max_model_len=2048)
            d = decoder(env, "decode", max_model_len=2048)
            servers += [p1, p2, d]
            up(servers)
            servers.append(r1 := front(env, "router-1", p1, kv1, d))
            servers.append(r2 := front(env, "router-2", p2, kv2, d))
            # and one router over both P's (for the failover after P1's kill)
            servers.append(both := router(
                python=env["python"], port=free_port(), prefill=[(p1.url, kv1), (p2.url, kv2)],
                decode=[d.url], log_dir=env["logs"], name="router-both"))
            both.wait_healthy(60)
            for r in (r1, r2):  # warm: first steps and handshakes done
                complete(r.url, prompts[2])
            yield {"p1": p1, "p2": p2, "d": d, "r1": r1, "r2": r2, "both": both}
        finally:
            stop(servers)

    def test_kill_prefill_mid_stream(self, trio, prompts, env, figures):
        d = trio["d"]
        results, in_flight = _traffic_with_kill(trio["r1"].url, prompts, trio["p1"],
                                                max_tokens=MAX_TOKENS)
        figures("e2e faults", "kill -9 P mid-stream: requests", len(results),
                f"{in_flight} in flight at the kill; {_summary(results)}")
        for r, prompt in zip(results, [prompts[12 + i % 8] for i in range(len(results))]):
            if r["done"] and not r["error"]:  # served: then served right
                assert r["text"] == env["reference"][prompt][2], r
            else:  # failed cleanly: an error status or event, not a silent truncation
                assert r["error"], r
        assert in_flight >= 1
        waited = assert_idle([d], within=IDLE_BOUND)
        figures("e2e faults", "kill -9 P: D idle (no request, no KV) after", waited)
        # D keeps serving, through the other producer
        prompt = prompts[5]
        got = complete(trio["r2"].url, prompt, timeout=REQUEST_BOUND_S)["choices"][0]
        assert signature(got) == env["reference"][prompt]
        assert metric(d.url, "vllm:kv_push_transfers_done_total") > 0

    def test_a_dead_prefill_costs_no_request_through_a_router_with_another(
            self, trio, prompts, env, figures):
        """P1 killed (by the test before; killed here if run alone): through a router over both
        P's every request is served -- one that picks P1 cannot connect its P leg, and moves to
        P2 before D's leg goes out, so D never dials P1's side channel -- also when P1's
        ejection (1 s, then 2 s) has run out and it is tried again. Until 2026-12-06 each such
        pick cost its client a 502."""
        p1, d, url = trio["p1"], trio["d"], trio["both"].url
        p1.kill9()
        fails0 = metric(d.url, "vllm:kv_push_handshake_failures_total")
        statuses = []
        for round_ in range(3):
            for i in range(4):  # round robin over the two P's: P1 is picked
                prompt = prompts[(4 * round_ + i) % 8]
                r = httpx.post(f"{url}/v1/completions", json=body(prompt),
                               timeout=REQUEST_BOUND_S)
                statuses.append(r.status_code)
                if r.status_code == 200:
                    assert signature(r.json()["choices"][0]) == env["reference"][prompt]
            time.sleep(2.5)  # past P1's back-off: it is tried again
        retries = metric(url, "kv_push_router_leg_retries_total", leg="prefill")
        figures("e2e faults", "a dead P among two: requests through the router served",
                f"{statuses.count(200)}/{len(statuses)}", f"P legs moved to the live P: "
                f"{retries:g}")
        assert statuses == [200] * len(statuses), statuses
        assert retries >= 2  # the first pick of P1, and one after its ejection ran out
        assert metric(d.url, "vllm:kv_push_handshake_failures_total") == fails0

    def test_kill_decode_mid_stream(self, trio, prompts, env, figures):
        p2 = trio["p2"]
        # long streams (the tiny model decodes a few ms per token): D dies under most of them
        results, in_flight = _traffic_with_kill(trio["r2"].url, prompts, trio["d"],
                                                max_tokens=1400)
        figures("e2e faults", "kill -9 D mid-stream: requests", len(results),
                f"{in_flight} in flight at the kill; {_summary(results)}")
        assert in_flight >= 1
        for r in results:  # complete (done before the kill), or an error: never cut silently
            assert (r["done"] and not r["error"]) or r["error"], r
        assert sum(bool(r["error"]) for r in results) >= 1, "the kill interrupted nothing"
        waited = assert_idle([p2], within=IDLE_BOUND)
        figures("e2e faults", "kill -9 D: P idle (no request, no KV) after", waited)
        prompt = prompts[5]  # P keeps serving (alone: nothing to push to)
        got = complete(p2.url, prompt, timeout=REQUEST_BOUND_S)["choices"][0]
        assert signature(got) == env["reference"][prompt]


# -- a server's API process killed alone ------------------------------------------------------


class TestApiServerKilledAlone:
    def test_a_producer_restarted_in_its_place_starts(self, env, figures):
        # kill -9 of P's API process alone: vLLM leaves its engine and worker running,
        # re-parented; our worker there held the side-channel port, and a P started in its
        # place failed "cannot listen on ...: Address already in use" (a walkthrough,
        # 2026-12-05). Now the worker notices its server is gone and closes (server_watch)
        old, kv_port = producer(env, "prefill-orphaned")
        new = None
        try:
            up([old])
            assert not bindable(kv_port)
            os.kill(old.proc.pid, signal.SIGKILL)  # the API process only, not its group
            t0 = time.monotonic()
            while not bindable(kv_port):
                assert time.monotonic() - t0 < 20, old.tail(30)
                time.sleep(0.1)
            figures("e2e faults", "API server killed alone: side-channel port free after",
                    time.monotonic() - t0)
            gone = [line for line in old.log_text().splitlines()
                    if "the vLLM server of this engine is gone" in line]
            assert gone and "ERROR" in gone[0], old.tail(30)
            assert any("VLLM::" in title_of(pid) for pid in _group(old.proc.pid)), \
                "vLLM's engine was expected to outlive its API process (it is left alone)"
            new = start(env, "prefill-restarted", 0, kv_role="kv_producer", kv_port=kv_port,
                        extra_config={"rendezvous_ttl_s": TTL})
            up([new])  # it listens on the same side-channel port
        finally:
            old.kill9()  # the orphaned engine and worker (and its ipc folder)
            stop([new] if new is not None else [])


def _group(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    out.append(int(entry))
            except ProcessLookupError:
                pass
    return out


# -- a frozen producer ---------------------------------------------------------------------------


#: heartbeats of the frozen-producer pair: D takes P for unresponsive 1.5 intervals after its
#: last heartbeat -- long enough that D registers a request sent right after the freeze first
FROZEN_HEARTBEAT_S = 4.0
#: D's fence_timeout_s there (the default): before failures were reported early, the clients of
#: a frozen P waited 1.5 heartbeats + 2 fence time-outs (66 s) for their error
FROZEN_FENCE_S = 30.0


def _signal_all(server: Server, sig: int) -> None:
    for pid in server.pids():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class TestFrozenProducer:
    @pytest.fixture(scope="class")
    def pair(self, env, prompts):
        servers = []
        cfg = {"heartbeat_interval_s": FROZEN_HEARTBEAT_S}
        try:
            p, kv = producer(env, "prefill-frozen", extra_config=cfg)
            d = decoder(env, "decode-frozen",
                        extra_config={**cfg, "fence_timeout_s": FROZEN_FENCE_S})
            d_re = decoder(env, "decode-frozen-recompute", cpu=0, extra_config=cfg,
                           kv_config={"kv_load_failure_policy": "recompute"})
            servers += [p, d, d_re]
            up(servers)
            servers.append(r := front(env, "router-frozen", p, kv, d))
            servers.append(r_re := front(env, "router-frozen-recompute", p, kv, d_re))
            for warm in (r, r_re):  # first steps and the handshakes
                complete(warm.url, prompts[2])
            assert_idle([p, d, d_re], within=IDLE_BOUND)
            yield {"p": p, "d": d, "r": r, "d_re": d_re, "r_re": r_re}
        finally:
            stop(servers)

    def test_a_frozen_producers_clients_get_their_error_without_waiting_out_the_fence(
            self, pair, prompts, env, figures):
        """P stops (SIGSTOP of every process: no heartbeat, no answer, TCP still accepted)
        right before two requests (one plain, one streamed) that D registers with it. D fails
        them once P is unresponsive, and vLLM answers their clients at once -- while D keeps
        their blocks (P may be frozen with a WRITE in flight) until P, resumed, answers the
        cancels. Then both servers are idle and the pair serves correctly again."""
        p, d, url = pair["p"], pair["d"], pair["r"].url
        early = "vllm:kv_push_load_failures_before_fence_end_total"
        before = metric(d.url, early)

        async def run() -> tuple[httpx.Response, float, dict]:
            async with httpx.AsyncClient(timeout=4 * FROZEN_FENCE_S) as client:
                t0 = time.monotonic()

                async def plain() -> tuple[httpx.Response, float]:
                    r = await client.post(f"{url}/v1/completions",
                                          json=body(prompts[7] + " frozen", max_tokens=8))
                    return r, time.monotonic() - t0

                (r, t_plain), s = await asyncio.gather(
                    plain(), _stream(client, url, prompts[8] + " frozen", 8, asyncio.Event()))
                return r, t_plain, s

        _signal_all(p, signal.SIGSTOP)
        try:
            r, t_plain, s = asyncio.run(run())
            held = busy(d)["kv_usage"]  # D still holds their blocks: P is still frozen
            reported = metric(d.url, early) - before
        finally:
            _signal_all(p, signal.SIGCONT)
        t_thawed = time.monotonic()
        figures("e2e faults", "frozen P (SIGSTOP): its clients' errors after",
                f"{t_plain:.1f} s / {s['elapsed']:.1f} s",
                f"plain / streamed; heartbeat {FROZEN_HEARTBEAT_S:.0f} s, fence "
                f"{FROZEN_FENCE_S:.0f} s (the fence bound would have been "
                f"{1.5 * FROZEN_HEARTBEAT_S + 2 * FROZEN_FENCE_S:.0f} s); D's KV usage "
                f"meanwhile {held:.4f}; reported before the fence ended: {reported:.0f}")
        assert r.status_code == 502, r.text  # the router dialled P's side channel: no answer
        err = r.json()["error"]
        assert err["type"] == "kv_side_channel_unreachable", err
        assert "connected, but no challenge" in err["message"], err
        assert s["error"] and not s["text"], s
        assert reported == 2, reported  # both failed while their blocks were fenced
        assert t_plain < FROZEN_FENCE_S and s["elapsed"] < FROZEN_FENCE_S, (t_plain, s)
        assert held > 0, "D held no blocks for the failed requests while P was frozen"
        waited = assert_idle([p, d], within=IDLE_BOUND)
        figures("e2e faults", "frozen P resumed: P and D idle after", f"{waited:.1f} s",
                f"{time.monotonic() - t_thawed:.1f} s after SIGCONT")
        prompt = prompts[5]
        choice = complete(url, prompt, timeout=REQUEST_BOUND_S)["choices"][0]
        assert signature(choice) == env["reference"][prompt]


    def test_with_recompute_the_request_waits_for_the_fence_then_d_computes_it(
            self, pair, prompts, env, figures):
        """``kv_load_failure_policy = recompute``: the failure reported early changes nothing
        for the client: vLLM recomputes into the request's blocks only once the fence ends
        (here: P resumed and answered), and the answer is the single server's."""
        p, d, url = pair["p"], pair["d_re"], pair["r_re"].url
        early = "vllm:kv_push_load_failures_before_fence_end_total"
        before = metric(d.url, early)
        prompt = prompts[9]
        with ThreadPoolExecutor(1) as pool:
            _signal_all(p, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                fut = pool.submit(httpx.post, f"{url}/v1/completions", json=body(prompt),
                                  timeout=4 * FROZEN_FENCE_S)
                while metric(d.url, early) - before < 1:
                    assert time.monotonic() - t0 < FROZEN_FENCE_S, "no failure reported"
                    assert not fut.done(), fut.result().text
                    time.sleep(0.5)
                t_reported = time.monotonic() - t0
                time.sleep(1.0)
                assert not fut.done(), fut.result().text  # waits for the fence, not failed
                held = busy(d)["kv_usage"]
            finally:
                _signal_all(p, signal.SIGCONT)
            r = fut.result()
            t_answered = time.monotonic() - t0
        figures("e2e faults", "frozen P, D with recompute: failure reported / answered after",
                f"{t_reported:.1f} s / {t_answered:.1f} s",
                f"P resumed at {t_reported + 1:.1f} s; D's KV usage meanwhile {held:.4f}")
        assert held > 0
        assert r.status_code == 200, r.text
        assert signature(r.json()["choices"][0]) == env["reference"][prompt]
        assert metric(d.url, "vllm:kv_push_load_failures_total", reason="recompute") >= 1
        assert_idle([p, d], within=IDLE_BOUND)


# -- the router's release ----------------------------------------------------------------------


#: P's rendezvous_ttl_s in TestReleaseOnHangUp: what would free an unclaimed prefill without a
#: release (the default)
RELEASE_TTL = 120


def _p_counters(p: Server) -> dict[str, float]:
    return {"released": metric(p.url, "vllm:kv_push_released_total"),
            "deferred": metric(p.url, "vllm:kv_push_release_deferred_total"),
            "expired": metric(p.url, "vllm:kv_push_expired_total"),
            "after_release": metric(p.url, "vllm:kv_push_stale_total",
                                    reason="registration_after_router_release"),
            "rejected": metric(p.url, "vllm:kv_push_release_rejected_total"),
            # a hang-up is no transfer failure: counted as abandoned, by reason
            "failed": metric(p.url, "vllm:kv_push_transfers_failed_total"),
            "abandoned": sum(metric(p.url, "vllm:kv_push_transfers_abandoned_total", reason=r)
                             for r in ABANDONED)}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


class TestReleaseOnHangUp:
    @pytest.fixture(scope="class")
    def rel(self, env, prompts):
        servers = []
        # a decode "server" that accepts connections (the kernel does) and never answers: the
        # router's D leg waits, and no decode engine ever sees the request
        hole = socket.create_server(("127.0.0.1", 0), backlog=128)
        try:
            p, kv = producer(env, "prefill-release", extra_config={"rendezvous_ttl_s": RELEASE_TTL})
            d = decoder(env, "decode-release")
            servers += [p, d]
            up(servers)
            servers.append(r := front(env, "router-release", p, kv, d))
            servers.append(r_hole := router(
                python=env["python"], port=free_port(), prefill=[(p.url, kv)],
                decode=[f"http://127.0.0.1:{hole.getsockname()[1]}"], log_dir=env["logs"],
                name="router-hole"))
            r_hole.wait_healthy(60)
            complete(r.url, prompts[2])  # warm: first steps and the handshake
            assert_idle([p, d], within=IDLE_BOUND)
            yield {"p": p, "d": d, "r": r, "r_hole": r_hole}
        finally:
            stop(servers)
            hole.close()

    def test_hang_ups_that_decode_never_saw_free_p_at_once(self, rel, prompts, figures):
        """Every client hangs up after P finished its prefill and before D said anything (D's
        engine never sees a request): P holds each prompt's KV, which nothing but the router's
        Release frees before the TTL."""
        p, url, n = rel["p"], rel["r_hole"].url, 12
        before = _p_counters(p)
        done0 = metric(p.url, "vllm:request_success_total")

        async def storm() -> tuple[float, float, float]:
            async with httpx.AsyncClient(timeout=4 * REQUEST_BOUND_S) as client:
                tasks = [asyncio.ensure_future(client.post(
                    f"{url}/v1/completions",
                    json=body(prompts[i % NUM_PROMPTS] + f" hole {i}", max_tokens=16)))
                    for i in range(n)]
                deadline = time.monotonic() + REQUEST_BOUND_S
                while metric(p.url, "vllm:request_success_total") - done0 < n:
                    assert time.monotonic() < deadline, "P did not finish the prefills"
                    assert not any(t.done() for t in tasks), [t.result() for t in tasks
                                                              if t.done()]
                    await asyncio.sleep(0.2)
                t_prefilled = time.monotonic()  # every prefill reported by now (or just after)
                held = busy(p)["kv_usage"]
                for t in tasks:  # the clients hang up
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return t_prefilled, time.monotonic(), held

        t_prefilled, t_hangup, held = asyncio.run(storm())
        waited = assert_idle([p], within=RELEASE_TTL / 2)
        t_idle = time.monotonic()
        got = _delta(_p_counters(p), before)
        figures("e2e faults", f"release: {n} hang-ups before D's first byte (D never sees "
                f"them): P's KV usage held / after", f"{held:.4f} -> 0",
                f"idle {waited:.1f} s after the hang-ups; TTL {RELEASE_TTL} s; {got}")
        assert held > 0, "P held no KV for the prefills (the test proves nothing)"
        # P let go before the TTL could have freed a single one of them, and by the release
        assert t_idle - t_prefilled < RELEASE_TTL, (t_idle - t_prefilled, got)
        assert got["released"] >= n and got["expired"] == 0, got
        assert got["rejected"] == 0, got

    def test_early_hang_up_storm_through_a_real_decoder_frees_both_before_the_ttl(
            self, rel, prompts, env, figures):
        """Clients hang up 20 ms to 0.5 s into their requests: some before P finished, some
        before D's engine saw the request, some while D registered or received. Both servers
        are idle long before P's TTL."""
        p, d, url = rel["p"], rel["d"], rel["r"].url
        before, before_d = _p_counters(p), _p_counters(d)
        t0 = time.monotonic()

        async def hang_up(prompt: str, after: float) -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                try:
                    await asyncio.wait_for(client.post(f"{url}/v1/completions", json={
                        "model": "tiny", "prompt": prompt, "max_tokens": 64,
                        "temperature": 0}), timeout=after)
                except asyncio.TimeoutError:
                    pass

        async def storm() -> None:
            await asyncio.gather(*(hang_up(prompts[i % NUM_PROMPTS] + f" storm {i}",
                                           0.02 + 0.03 * i) for i in range(16)))

        asyncio.run(storm())
        waited = assert_idle([p, d], within=RELEASE_TTL / 2)
        elapsed = time.monotonic() - t0
        prompt = prompts[5]  # and the pair still serves correctly
        choice = complete(url, prompt, timeout=REQUEST_BOUND_S)["choices"][0]
        assert signature(choice) == env["reference"][prompt]
        # (read after that request: a worker's counters reach /metrics with an engine step)
        got = _delta(_p_counters(p), before)
        got_d = _delta(_p_counters(d), before_d)
        figures("e2e faults", "release: early hang-up storm through a real D (16 requests): "
                "P and D idle after", f"{waited:.1f} s", f"TTL {RELEASE_TTL} s; P {got}; "
                f"D failed {got_d['failed']:g} abandoned {got_d['abandoned']:g}")
        assert elapsed < RELEASE_TTL, got  # before any prefill could expire
        assert got["expired"] == 0 and got["rejected"] == 0, got
        # hang-ups are not transfer failures on either side (counted as abandoned)
        assert got["failed"] == 0 and got_d["failed"] == 0, (got, got_d)


# -- TP 2 --------------------------------------------------------------------------------------


#: Four TP workers (2 per server) on the 2 cores of this box starve the workers' transfer
#: threads: with the defaults a server's first steps took over 10 s, a worker went unheard for
#: 7.5 s (a false "dead": 5 s heartbeat) and a handshake timed out (5 s). So here: long time-outs
#: and heartbeat, and both servers warmed.
TP2_CONFIG = {"rendezvous_ttl_s": 300, "heartbeat_interval_s": 30, "handshake_timeout_s": 60}


class TestChunkedProducer:
    @pytest.fixture(scope="class")
    def chunked(self, env, prompts):
        servers = []
        try:
            # every prompt (130-600 tokens) is prefilled in chunks of at most 128 tokens on P
            p, kv = producer(env, "prefill-chunked",
                             vllm_args=["--max-num-batched-tokens", "128"])
            d = decoder(env, "decode-chunked")
            servers += [p, d]
            up(servers)
            servers.append(r := front(env, "router-chunked", p, kv, d))
            complete(r.url, prompts[2])  # warm: first steps and the handshake
            yield {"p": p, "d": d, "r": r, "kv": kv}
        finally:
            stop(servers)

    def test_outputs_identical_to_single_server(self, chunked, env, prompts):
        d, url = chunked["d"], chunked["r"].url
        local0 = metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_compute")
        ext0 = metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        for prompt in prompts[3:9]:
            assert signature(complete(url, prompt)["choices"][0]) == env["reference"][prompt]
        assert metric(d.url, "vllm:prompt_tokens_by_source_total",
                      source="local_compute") == local0
        assert metric(d.url, "vllm:prompt_tokens_by_source_total",
                      source="external_kv_transfer") - ext0 >= 6 * 130

    def test_a_seeded_sampling_request_is_served_with_p_alive(self, chunked, prompts):
        p, url = chunked["p"], chunked["r"].url
        texts = []
        for _ in range(2):
            r = httpx.post(f"{url}/v1/completions", json=body(
                prompts[9], temperature=0.8, seed=11, logprobs=None, return_token_ids=False),
                timeout=REQUEST_BOUND_S)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert texts[0] == texts[1]  # the seed reached D, which samples every token
        assert httpx.get(f"{p.url}/health", timeout=10).status_code == 200
        assert "CPU Generator does not use offset" not in p.log_text()

    def test_a_hang_up_on_p_mid_prefill_is_abandoned_not_failed(self, chunked, prompts, env,
                                                                  figures):
        """A client that sends both legs itself (our form, no router) hangs up P's leg while
        P's engine has it in a chunked prefill and D waits for its KV. vLLM aborts P's request
        mid-prefill (FINISHED_ABORTED): P tells D at once, and both count it as
        ``transfers_abandoned{prefill_aborted}``, not as a failed transfer; D's request ends
        long before its ``transfer_timeout_s`` (60 s), and both servers end idle.

        To make the abort land mid-prefill every time, P's engine process is stopped
        (SIGSTOP, 1 s: under the heartbeat's 7.5 s) while P's API process takes the leg and the
        hang-up: resumed, the engine finds the request and its abort queued, and the prompt
        (900 tokens) needs 8 of P's 128-token steps."""
        p, d, kv, url = chunked["p"], chunked["d"], chunked["kv"], chunked["r"].url
        engines = [pid for pid in p.pids() if "EngineCore" in title_of(pid)]
        assert len(engines) == 1, [(pid, title_of(pid)) for pid in p.pids()]
        before, before_d = _p_counters(p), _p_counters(d)
        tid = uuid.uuid4().hex
        ids = random.Random(tid).choices(range(20, 290), k=900)
        leg = {"model": "tiny", "prompt": ids, "max_tokens": 4, "temperature": 0}
        d_leg = dict(leg, kv_transfer_params={"transfer_id": tid, "do_remote_prefill": True,
                                              "remote_host": "127.0.0.1", "remote_port": kv})
        p_leg = dict(leg, max_tokens=1, stream=True,
                     kv_transfer_params={"transfer_id": tid, "do_remote_decode": True})

        async def legs() -> tuple[httpx.Response, float]:
            async with httpx.AsyncClient(timeout=REQUEST_BOUND_S) as client:
                t0 = time.monotonic()
                d_task = asyncio.ensure_future(client.post(f"{d.url}/v1/completions",
                                                           json=d_leg))
                await asyncio.sleep(1.0)  # D schedules it and registers with P
                assert not d_task.done(), d_task.result().text
                for pid in engines:
                    os.kill(pid, signal.SIGSTOP)
                try:
                    p_task = asyncio.ensure_future(client.post(f"{p.url}/v1/completions",
                                                               json=p_leg))
                    await asyncio.sleep(0.5)  # P's API process hands the request on
                    p_task.cancel()  # the hang-up
                    await asyncio.gather(p_task, return_exceptions=True)
                    await asyncio.sleep(0.5)  # ... and its abort
                finally:
                    for pid in engines:
                        os.kill(pid, signal.SIGCONT)
                t_resumed = time.monotonic()
                resp = await d_task
                return resp, time.monotonic() - t_resumed

        resp, d_after = asyncio.run(legs())
        waited = assert_idle([p, d], within=IDLE_BOUND)
        # the pair still serves; and its steps bring the workers' counters to /metrics
        prompt = prompts[4]
        assert signature(complete(url, prompt)["choices"][0]) == env["reference"][prompt]
        got, got_d = _delta(_p_counters(p), before), _delta(_p_counters(d), before_d)
        aborted = metric(p.url, "vllm:kv_push_transfers_abandoned_total",
                         reason="prefill_aborted")
        figures("e2e faults", "a hang-up on P's leg mid-prefill while D waits: D's request "
                "ended after P's engine resumed", f"{d_after:.2f} s",
                f"D answered {resp.status_code}; idle {waited:.1f} s later; P {got}; "
                f"D {got_d}")
        assert d_after < 20, d_after  # told at once, not at D's transfer_timeout_s (60 s)
        assert got["abandoned"] == 1 and aborted >= 1, got
        assert got_d["abandoned"] == 1, got_d
        assert got["failed"] == 0 and got_d["failed"] == 0, (got, got_d)


class TestTensorParallel2:
    @pytest.fixture(scope="class")
    def tp2(self, env, prompts, figures):
        if (os.cpu_count() or 1) < 4 and not os.environ.get("KV_PUSH_E2E_TP2"):
            pytest.skip(f"P and D at TP 2 need 4 cores (4 TP workers), this box has "
                        f"{os.cpu_count()}: see the module docstring for what happens on 2 "
                        "(KV_PUSH_E2E_TP2=1 runs it anyway)")
        servers = []
        try:
            p, kv = producer(env, "prefill-tp2", cpu="0|1", tp=2, extra_config=TP2_CONFIG)
            d = decoder(env, "decode-tp2", cpu="0|1", tp=2, extra_config=TP2_CONFIG)
            servers += [p, d]
            up(servers)
            figures("e2e faults", "TP 2: resident memory of P and D",
                    f"{p.rss_bytes() / 2**30:.1f} + {d.rss_bytes() / 2**30:.1f} GiB")
            complete(d.url, prompts[NUM_PROMPTS - 1])  # D's first steps, alone
            # P alone (no kv_transfer_params) is a single server at TP 2: the reference
            reference = {q: signature(complete(p.url, q)["choices"][0]) for q in prompts[:8]}
            servers.append(r := front(env, "router-tp2", p, kv, d))
            t0 = time.monotonic()
            complete(r.url, prompts[9], timeout=300)  # the handshakes of both ranks
            figures("e2e faults", "TP 2: first request through P and D", time.monotonic() - t0)
            yield {"p": p, "d": d, "router": r, "reference": reference}
        finally:
            stop(servers)

    def test_outputs_identical_to_single_server_at_tp2(self, tp2, prompts, env, figures):
        d = tp2["d"]
        got = {q: signature(complete(tp2["router"].url, q)["choices"][0]) for q in prompts[:8]}
        same_as_tp1 = sum(got[q] == env["reference"][q] for q in got)
        figures("e2e faults", "TP 2 P/D outputs equal to a TP 1 server's", f"{same_as_tp1}/8")
        assert got == tp2["reference"]
        assert metric(d.url, "vllm:prompt_tokens_by_source_total",
                      source="external_kv_transfer") > 0
        assert metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
        # each D rank counted its own completions: both ranks' transfers are in the total
        assert metric(d.url, "vllm:kv_push_transfers_done_total") >= 2 * 8
        assert_idle([tp2["p"], d], within=IDLE_BOUND)
