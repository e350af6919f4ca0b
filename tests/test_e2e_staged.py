"""Staged transfers end to end on real vLLM (CPU build): host backend, opaque [K|V] blocks.

The same setup as ``test_e2e_vllm.py`` (one server alone for reference outputs, then a prefill
server and a decode server with ``KVPushConnector`` behind ``kv-push-router``), but both workers
own a host staging pool (``decoder_staging_bytes`` / ``producer_staging_bytes``; the host
backend's default is none): every transfer is packed as whole opaque blocks on P, WRITTEN in
chunks into D's slot and unpacked into D's blocks. Greedy tokens and per-token logprobs must equal
the single server's, including decoder prefix-cache hits, concurrent requests and after an abort
storm; the connector's counters (vLLM's /metrics) must show the staged path ran and never fell
back.

Layer-wise streaming (``layerwise``, on by default where P stages) runs here too: vLLM's CPU
build calls ``save_kv_layer`` per attention layer, so P packs each layer's blocks as the forward
writes them and WRITEs each chunk during the prefill; the counters must show transfers written
from those streams. A decoder prefix hit takes the deferred (post-prefill) staged path, and one
case sends the two legs by hand so that D registers only after P's prefill finished.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from e2e_support import NUM_PROMPTS
from e2e_support import body as _body
from e2e_support import signature as _signature
from e2e_support import venvs as _venvs
from test_e2e_vllm import _complete, prompts, tiny_model  # noqa: F401 - fixtures are used by name
from kv_push.common.testing.vllm_servers import free_port, metric, router, vllm_server

pytestmark = pytest.mark.e2e

STAGING = {"decoder_staging_bytes": 16 << 20, "producer_staging_bytes": 16 << 20,
           "staging_chunk_bytes": 128 << 10}  # tiny model: ~1 KiB per token, so 2+ chunks
USED = list(range(8))  # the prompts these tests send (plus the two prefix-sharing ones)
LATE = (8, 9)  # sent leg by leg, never seen by either server before


@pytest.fixture(scope="module", params=_venvs(), ids=lambda v: f"vllm-{v[0]}")
def staged_stack(request, tiny_model, prompts, tmp_path_factory):
    version, python = request.param
    if not Path(python).exists():
        pytest.fail(f"vLLM {version} environment {python} is missing")
    logs = tmp_path_factory.mktemp(f"staged-logs-{version}")
    wanted = [prompts[i] for i in USED + list(LATE)] + prompts[NUM_PROMPTS:]
    single = vllm_server("single", python=python, model=str(tiny_model), port=free_port(),
                         cpu=0, log_dir=logs)
    try:
        single.wait_healthy()
        _complete(single.url, prompts[1])  # warm-up
        reference = {p: _signature(_complete(single.url, p)) for p in wanted}
    finally:
        single.stop()
    kv_port = free_port()
    p = vllm_server("prefill", python=python, model=str(tiny_model), port=free_port(), cpu=0,
                    log_dir=logs, kv_role="kv_producer", kv_port=kv_port,
                    extra_config={"rendezvous_ttl_s": 15, **STAGING})
    d = vllm_server("decode", python=python, model=str(tiny_model), port=free_port(), cpu=1,
                    log_dir=logs, kv_role="kv_consumer", kv_port=free_port(),
                    extra_config=STAGING)
    servers = [p, d]
    try:
        p.wait_healthy()
        d.wait_healthy()
        r = router(python=python, port=free_port(), prefill=[(p.url, kv_port)], decode=[d.url],
                   log_dir=logs)
        servers.append(r)
        r.wait_healthy(60)
        _complete(r.url, prompts[2])  # warm-up: first forward passes and the handshake
        yield {"p": p, "d": d, "router": r, "reference": reference, "kv_port": kv_port}
    finally:
        for s in reversed(servers):
            s.stop()


def staged_counts(stack) -> dict[str, float]:
    out = {}
    for side in ("p", "d"):
        url = stack[side].url
        for name in ("staged_transfers", "staged_chunks", "staged_fallback", "transfers_done",
                     "layerwise_streams", "layerwise_transfers", "layerwise_fallback"):
            out[f"{side}.{name}"] = metric(url, f"vllm:kv_push_{name}_total")
    return out


def test_staged_outputs_identical_to_single_server(staged_stack, prompts):
    d = staged_stack["d"]
    ext0 = metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    before = staged_counts(staged_stack)
    mismatches = []
    for i in USED:
        choice = _complete(staged_stack["router"].url, prompts[i])
        if _signature(choice) != staged_stack["reference"][prompts[i]]:
            mismatches.append((i, _signature(choice), staged_stack["reference"][prompts[i]]))
    assert not mismatches, mismatches[:2]
    after = staged_counts(staged_stack)
    got = {k: after[k] - before[k] for k in after}
    n = len(USED)
    # stats reach /metrics with a step's delay: the last request may not be counted yet
    assert got["p.staged_transfers"] >= n - 1 and got["d.staged_transfers"] >= n - 1, got
    assert got["d.staged_chunks"] >= 2 * (n - 1), got  # several chunks per request
    assert after["p.staged_fallback"] == 0 and after["d.staged_fallback"] == 0, after
    # layer-wise: each prefill was streamed and written from its stream -- but for a decoder
    # prefix hit (D served the warm-up's prompt before), which waits for the complete prefill
    # (``layerwise_fallback{layout}``); never for want of room or an error
    assert got["p.layerwise_streams"] >= n - 1, got
    assert got["p.layerwise_transfers"] + got["p.layerwise_fallback"] >= n - 1, got
    assert got["p.layerwise_transfers"] >= n - 2, got
    p_url = staged_stack["p"].url
    for reason in ("producer_pool", "error"):
        assert metric(p_url, "vllm:kv_push_layerwise_fallback_total", reason=reason) == 0
    local = metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_compute")
    ext = metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - ext0
    assert ext > 0 and local == 0, (ext, local)


def test_staged_prefix_cache_hit_on_decoder(staged_stack, prompts):
    d, url = staged_stack["d"], staged_stack["router"].url
    base, partial, again = prompts[0], prompts[NUM_PROMPTS], prompts[NUM_PROMPTS + 1]
    assert _signature(_complete(url, base)) == staged_stack["reference"][base]
    hit0 = metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    ext0 = metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    for prompt in (partial, again):
        assert _signature(_complete(url, prompt)) == staged_stack["reference"][prompt]
    assert metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") > hit0
    assert metric(d.url, "vllm:prompt_tokens_by_source_total",
                  source="external_kv_transfer") > ext0


def test_staged_concurrent_requests_and_abort_storm(staged_stack, prompts):
    url, p, d = staged_stack["router"].url, staged_stack["p"], staged_stack["d"]

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(prompt):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                        "logprobs": 1, "return_token_ids": True}
                r = await client.post(f"{url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return prompt, _signature(r.json()["choices"][0])
            return await asyncio.gather(*(one(prompts[i]) for i in USED))

    for prompt, sig in asyncio.run(run()):
        assert sig == staged_stack["reference"][prompt]

    async def hang_up(prompt, after):
        async with httpx.AsyncClient(timeout=60) as client:
            try:
                await asyncio.wait_for(client.post(f"{url}/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 64, "temperature": 0}),
                    timeout=after)
            except asyncio.TimeoutError:
                pass

    async def storm():
        await asyncio.gather(*(hang_up(prompts[i % 8] + f" staged abort {i}", 0.02 + 0.03 * i)
                               for i in range(8)))

    asyncio.run(storm())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        busy = sum(metric(s.url, name) for s in (p, d)
                   for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        if busy == 0:
            break
        time.sleep(0.5)
    assert busy == 0, "requests still in flight after every client hung up"
    for i in (3, 5):  # slots freed by aborted requests are reused correctly
        assert _signature(_complete(url, prompts[i])) == staged_stack["reference"][prompts[i]]
    assert metric(d.url, "vllm:kv_push_staged_fallback_total") == 0


def test_staged_registration_after_the_prefill(staged_stack, prompts):
    """The two legs by hand, P's first: P's prefill is complete (and its KV held) before D
    even sees the request, so D's registration meets a finished prefill -- written from the
    layer-wise stream, with outputs identical to the single server."""
    p, d = staged_stack["p"], staged_stack["d"]
    before = staged_counts(staged_stack)
    for i in LATE:
        prompt, tid = prompts[i], f"late-registration-{i}"
        leg = httpx.post(f"{p.url}/v1/completions", timeout=120, json=dict(
            _body(prompt), max_tokens=1,
            kv_transfer_params={"transfer_id": tid, "do_remote_decode": True}))
        assert leg.status_code == 200, leg.text
        r = httpx.post(f"{d.url}/v1/completions", timeout=120, json=dict(
            _body(prompt), kv_transfer_params={
                "transfer_id": tid, "do_remote_prefill": True, "remote_host": "127.0.0.1",
                "remote_port": staged_stack["kv_port"]}))
        assert r.status_code == 200, r.text
        assert _signature(r.json()["choices"][0]) == staged_stack["reference"][prompt]
    deadline = time.monotonic() + 10
    while True:  # stats reach /metrics a step late
        got = {k: v - before[k] for k, v in staged_counts(staged_stack).items()}
        if got["p.layerwise_transfers"] >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got["p.layerwise_transfers"] >= 2 and got["d.staged_transfers"] >= 2, got
    assert metric(p.url, "vllm:kv_push_registrations_late_total") >= 2
