"""The P/D overhead benchmark without servers: the legs each variant sends, the TTFT it takes
(P's leg's first token event), and the differences and ratios of its report."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_pd_overhead as po  # noqa: E402

SSE = (b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
       b'data: {"choices": [], "usage": {}}\n\ndata: [DONE]\n\n')
URLS = {"p": "http://p", "d": "http://d", "router": "http://r", "single": "http://s",
        "kv_port": 5600}


def run_one(variant: str, status: int = 200):
    seen: list[tuple[str, dict, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, json.loads(request.content),
                     request.headers.get("x-request-id", "")))
        return httpx.Response(status, content=SSE if status == 200 else b"nope")

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await po.one(client, variant, [11, 12, 13], URLS, max_tokens=4)
    return asyncio.run(go()), seen


def test_push_legs_carry_one_transfer_id_and_the_side_channel():
    rec, seen = run_one("legs_push")
    legs = {host: (body, rid) for host, body, rid in seen}
    assert set(legs) == {"p", "d"}
    (p_body, p_rid), (d_body, d_rid) = legs["p"], legs["d"]
    tid = p_body["kv_transfer_params"]["transfer_id"]
    assert p_body["kv_transfer_params"] == {"transfer_id": tid, "do_remote_decode": True}
    assert d_body["kv_transfer_params"] == {"transfer_id": tid, "do_remote_prefill": True,
                                            "remote_host": "127.0.0.1", "remote_port": 5600}
    assert p_rid == d_rid == tid
    assert p_body["max_tokens"] == 1 and d_body["max_tokens"] == 4
    assert p_body["prompt"] == d_body["prompt"] == [11, 12, 13]
    assert rec["ttft"] > 0 and rec["d_first"] > 0


@pytest.mark.parametrize("variant,hosts", [("p_alone", {"p"}), ("legs_plain", {"p", "d"})])
def test_plain_variants_send_no_transfer_parameters(variant, hosts):
    rec, seen = run_one(variant)
    assert {host for host, _, _ in seen} == hosts
    assert all("kv_transfer_params" not in body for _, body, _ in seen)
    assert ("d_first" in rec) == ("d" in hosts)


def test_router_and_single_get_the_whole_request():
    for variant, host in (("router", "r"), ("single", "s"), ("single_beside_d", "s"),
                          ("d_alone", "d")):
        rec, seen = run_one(variant)
        assert [(h, b["max_tokens"], "kv_transfer_params" in b) for h, b, _ in seen] == \
            [(host, 4, False)]
        assert rec["variant"] == variant


def test_an_error_status_raises():
    with pytest.raises(RuntimeError, match="HTTP 503"):
        run_one("p_alone", status=503)


def test_prompts_differ_across_variants_and_rounds():
    prompts = po.prompts_for(["a", "b"], 3, 20, seed=1)
    flat = [tuple(p) for v in ("a", "b") for p in prompts[v]]
    assert len(set(flat)) == 6 and all(len(p) == 20 for p in flat)


def test_summary_differences_and_ratios():
    ttft = {"p_alone": [20, 21, 22], "legs_plain": [21, 22, 23], "legs_push": [23, 24, 25],
            "router": [25, 26, 27], "single": [19, 20, 21], "single_beside_d": [19.5, 20, 20.5]}
    reqs = [{"variant": v, "ttft": t} for v, ts in ttft.items() for t in ts]
    reqs.append({"variant": "router", "error": "boom"})
    reqs += [{"variant": "legs_push", "ttft": 24, "d_first": 30}]
    reqs[6]["d_first"] = 28  # legs_push's first

    s = po.summarize(reqs)
    assert {d["variant"]: d["p50_ms"] for d in s["differences"]} == \
        {"p_alone": 1, "legs_plain": 1, "legs_push": 2, "router": 2}
    assert s["ratio_to_single"]["router"] == pytest.approx(26 / 20)
    assert s["failed"] == 1 and s["ttft"]["router"]["n"] == 3
    meta = {"command": "x", "date": "d", "commit": "c", "prompt_len": 3, "max_tokens": 4,
            "requests": 3, "gap_s": 0.0, "cpus": 2, "load_before": [0.1], "load_after": [0.2]}
    md = po.report_md({"summary": s, "meta": meta})
    assert "| router | 26.0 ms | 26.8 ms | 25.0 ms | 3 | 1.30x |" in md  # p90 interpolated
    assert "| legs_push - legs_plain | +2.0 |" in md
    assert s["d_first"]["legs_push"]["n"] == 2 and s["d_first"]["legs_plain"] is None
    assert "| legs_push, D's first token | 29.0 ms |" in md


def test_rounds_are_shuffled_and_warm_up_is_not_recorded(monkeypatch):
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        return httpx.Response(200, content=SSE)

    real = httpx.AsyncClient
    monkeypatch.setattr(po.httpx, "AsyncClient",
                        lambda **kw: real(transport=httpx.MockTransport(handler)))
    variants = ["p_alone", "router", "single"]
    prompts = po.prompts_for(variants, 12, 5, seed=1)
    out = asyncio.run(po.run_variants(URLS, variants, prompts, 4, 0.0, warmup=2))
    assert [sum(r["variant"] == v for r in out) for v in variants] == [10, 10, 10]
    orders = {tuple(r["variant"] for r in out[i:i + 3]) for i in range(0, 30, 3)}
    assert len(orders) > 1 and all(sorted(o) == sorted(variants) for o in orders)
    assert len(seen) == 36  # the warm-up rounds were sent


def test_a_failed_leg_cancels_the_other_and_is_recorded(monkeypatch):
    cancelled = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p":
            return httpx.Response(500, content=b"boom")
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return httpx.Response(200, content=SSE)

    real = httpx.AsyncClient
    monkeypatch.setattr(po.httpx, "AsyncClient",
                        lambda **kw: real(transport=httpx.MockTransport(handler)))
    prompts = po.prompts_for(["legs_push"], 2, 5, seed=1)
    out = asyncio.run(po.run_variants(URLS, ["legs_push"], prompts, 4, 0.0, warmup=0))
    assert [("HTTP 500" in r.get("error", "")) for r in out] == [True, True]
    assert cancelled == [True, True]


def test_the_optional_router_variant_is_compared_only_where_it_ran():
    ttft = {"router": [25, 26, 27], "router_d_core": [24, 25, 26], "single": [20]}
    reqs = [{"variant": v, "ttft": t} for v, ts in ttft.items() for t in ts]
    diffs = {d["variant"]: d["p50_ms"] for d in po.summarize(reqs)["differences"]}
    assert diffs["router_d_core"] == -1 and diffs["p_alone"] is None
    assert "router_d_core" not in {d["variant"] for d in po.summarize(reqs[:3])["differences"]}
    assert "router_d_core" not in po.DEFAULT_VARIANTS
