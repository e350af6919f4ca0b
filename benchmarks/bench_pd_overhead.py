#!/usr/bin/env python3
"""Where P/D's TTFT over a single server goes, by taking parts away (issue 12 item 4).

One P (core 0) and one D (core 1) with ``KVPushConnector``, real ``vllm serve`` (CPU build, the
suite's tiny model), and our router (first token from P: ``--first-token-from-prefill auto``).
One client (httpx ``AsyncClient``) sends streaming ``/v1/completions`` of random token-id
prompts, one request at a time, back to back (``--gap-s``), the variants below interleaved
round by round, each round in a shuffled order, so that the box's slow and fast spells weigh on
all alike and each variant follows each other about equally often:

* ``p_alone``: P's leg only (``max_tokens`` 1), no ``kv_transfer_params``: P serves it as a
  plain vLLM server would; its connector takes no part;
* ``legs_plain``: P's leg and D's leg (the whole request) at once, neither with
  ``kv_transfer_params``: D computes its prompt itself, no transfer. Against ``p_alone``:
  what a concurrent D leg costs P's answer (the client's second leg, D's work on the box);
* ``legs_push``: the same two legs with our push parameters (one transfer id, P's
  ``do_remote_decode``, D's ``do_remote_prefill`` with P's side channel), sent by the client
  itself (unsigned: the servers run without a secret): D registers, P WRITEs. Against
  ``legs_plain``: what the push protocol costs P's answer (D's registration, P's pairing and
  WRITE on P's core);
* ``router``: the whole request through the router, which sends those legs and streams P's
  token first. Against ``legs_push``: the router's two hops;
* ``router_d_core`` (not run by default): the same through a second router bound to D's core
  (``taskset``) instead of floating. Against ``router``: whether the router loses time to P's
  prefill on core 0 (2026-12-06: -0.2 ms, ``pd_overhead.router_d_core.md``).

TTFT is the client's first token event: P's leg's for the three leg variants, the router's
stream's for ``router`` (the router's ``first_token_total`` counts, recorded, say whether
they came from P). A single server alone on core 0 (``single``, started after P/D is stopped,
the same number of fresh prompts back to back) is the floor. It is not interleaved with the
P/D variants (it needs core 0), so its ratios move with each start: P's leg alone, which is a
plain vLLM server's answer, shows by how much. Before that, the same single server runs
``single_beside_d``: its requests interleaved with D computing plain requests of its own
(``d_alone``) on core 1, as P's answers had D busy beside them.

The stage breakdown of a push request (``bench_ttft_breakdown.py``) shows when each stage is
reached; this shows what each part adds, on the same servers in the same minutes. The
differences are between medians of interleaved samples, so read them as estimates: the box's
spells move every variant.

Output: ``--out`` (JSON with every request) and the same path with ``.md``.

Usage::

    .venv/bin/python benchmarks/bench_pd_overhead.py                 # ~3 min here
    .venv/bin/python benchmarks/bench_pd_overhead.py --requests 40 --prompt-len 300
    .venv/bin/python benchmarks/bench_pd_overhead.py --variants p_alone,router  # a pair only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench_meta import add_python_arg, cpu_isa, server_dtype, source_commit
from bench_ttft_breakdown import FIRST_FROM_P, log, pct, prompts
from kv_push.common.testing.sse_lines import asse_lines
from kv_push.common.testing.vllm_servers import (build_tiny_model, free_port, metric, router,
                                                 vllm_server)

REPO = Path(__file__).resolve().parents[1]

VARIANTS = ("p_alone", "legs_plain", "legs_push", "router", "router_d_core")
#: run unless ``--variants`` says otherwise (``router_d_core``: a second router bound to D's
#: core; against ``router``, whether a floating router loses time to P's prefill on its core)
DEFAULT_VARIANTS = VARIANTS[:4]
#: variants that send the client's whole request to one server: variant -> its ``urls`` key
#: (``d_alone``: D computing plain requests beside ``single_beside_d``)
WHOLE = {"router": "router", "router_d_core": "router_d_core", "single": "single",
         "single_beside_d": "single", "d_alone": "d"}
#: (variant, the variant it is compared with, what the difference is)
DIFFERENCES = [
    ("p_alone", "single_beside_d", "P's plain answer against a single server's, both with D "
     "computing beside them (P's connector, the router idle, the start)"),
    ("legs_plain", "p_alone", "a concurrent D leg (no transfer)"),
    ("legs_push", "legs_plain", "the push protocol on P's answer (registration, pairing, WRITE)"),
    ("router", "legs_push", "the router's two hops"),
    ("router_d_core", "router", "the router bound to D's core instead of floating"),
]


def leg_bodies(variant: str, prompt: list[int], max_tokens: int, kv_host: str, kv_port: int,
               tid: str) -> tuple[dict | None, dict | None]:
    """P's and D's leg bodies of a leg variant (``None``: that leg is not sent)."""
    whole = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
             "stream": True, "ignore_eos": True}
    p_leg = dict(whole, max_tokens=1)
    if variant == "p_alone":
        return p_leg, None
    if variant == "legs_plain":
        return p_leg, dict(whole)
    if variant == "legs_push":
        return (dict(p_leg, kv_transfer_params={"transfer_id": tid, "do_remote_decode": True}),
                dict(whole, kv_transfer_params={"transfer_id": tid, "do_remote_prefill": True,
                                                "remote_host": kv_host, "remote_port": kv_port}))
    raise ValueError(f"not a leg variant: {variant}")


async def first_token_ms(client: httpx.AsyncClient, url: str, body: dict, t0: float,
                         headers: dict | None = None) -> float:
    """Stream ``body`` to ``url``'s completions to its end; the first token event's arrival,
    ms after ``t0``."""
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json=body,
                             headers=headers) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {resp.text[:200]}")
        async for line in asse_lines(resp.aiter_bytes()):
            if first is None and line.startswith("data: {") and '"text"' in line:
                first = (time.perf_counter() - t0) * 1000
    if first is None:
        raise RuntimeError(f"{url}: no token streamed")
    return first


async def one(client: httpx.AsyncClient, variant: str, prompt: list[int], urls: dict,
              max_tokens: int) -> dict:
    """One request of ``variant``: its TTFT (and D's first event where D's leg is the
    client's own)."""
    t0 = time.perf_counter()
    if variant in WHOLE:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}
        url = urls[WHOLE[variant]]
        return {"variant": variant, "ttft": await first_token_ms(client, url, body, t0)}
    tid = uuid.uuid4().hex
    p_body, d_body = leg_bodies(variant, prompt, max_tokens, "127.0.0.1", urls["kv_port"], tid)
    headers = {"X-Request-Id": tid}
    legs = [asyncio.ensure_future(first_token_ms(client, urls["p"], p_body, t0, headers))]
    if d_body is not None:
        legs.append(asyncio.ensure_future(first_token_ms(client, urls["d"], d_body, t0,
                                                         headers)))
    try:
        got = await asyncio.gather(*legs)
    except BaseException:  # one leg failed: the other must not run on into the next request
        for leg in legs:
            leg.cancel()
        await asyncio.gather(*legs, return_exceptions=True)
        raise
    rec = {"variant": variant, "ttft": got[0]}
    if len(got) > 1:
        rec["d_first"] = got[1]
    return rec


def stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"n": len(values), "p50_ms": pct(values, 0.5), "p90_ms": pct(values, 0.9),
            "min_ms": min(values)}


def summarize(requests: list[dict]) -> dict:
    """Per variant (and ``single``) TTFT stats, the differences of medians and the ratios to
    the single server."""
    by: dict[str, list[float]] = {}
    for r in requests:
        if "ttft" in r:
            by.setdefault(r["variant"], []).append(r["ttft"])
    out: dict[str, Any] = {"ttft": {v: stats(t) for v, t in by.items()}}
    # D's first token event where the client sent D's leg itself: with push, the TTFT a
    # first token from D would have without the router
    out["d_first"] = {v: stats([r["d_first"] for r in requests
                                if r["variant"] == v and "d_first" in r])
                      for v in ("legs_plain", "legs_push")}
    p50 = {v: s["p50_ms"] for v, s in out["ttft"].items() if s}
    out["differences"] = [{"variant": a, "against": b, "what": what,
                           "p50_ms": p50[a] - p50[b] if a in p50 and b in p50 else None}
                          for a, b, what in DIFFERENCES
                          if a in DEFAULT_VARIANTS or a in by]  # (an optional one: if run)
    if "single" in p50:
        out["ratio_to_single"] = {v: p50[v] / p50["single"] for v in p50 if v != "single"}
    out["failed"] = sum(1 for r in requests if "error" in r)
    return out


def report_md(result: dict) -> str:
    m, s = result["meta"], result["summary"]
    lines = ["# P/D's TTFT over a single server, by taking parts away", "",
             f"`{m['command']}` at {m['date']} (commit {m['commit']}), vLLM CPU build, tiny "
             f"model, prompt {m['prompt_len']} tokens, {m['max_tokens']} output tokens, "
             f"{m['requests']} requests per variant, interleaved, back to back (gap "
             f"{m['gap_s']} s); P on core 0, D on core 1, router and client floating; the "
             f"single server alone on core 0 afterwards. {m['cpus']} cores"
             f"{' (' + ', '.join(m['cpu_isa']) + ')' if m.get('cpu_isa') else ''}; servers' dtype "
             f"{m.get('server_dtype', '-')}; load (1 min) "
             f"{m['load_before'][0]:.1f} -> {m['load_after'][0]:.1f}. Failed requests: "
             f"{s['failed']}. The router's first tokens (warm-up included): "
             f"{m.get('router_first_token', '-')}.", "",
             "| variant | TTFT p50 | p90 | min | n | / single p50 |", "|---|---|---|---|---|---|"]
    for v in (*VARIANTS, "single_beside_d", "single"):
        st = s["ttft"].get(v)
        if not st:
            continue
        ratio = s.get("ratio_to_single", {}).get(v)
        lines.append(f"| {v} | {st['p50_ms']:.1f} ms | {st['p90_ms']:.1f} ms | "
                     f"{st['min_ms']:.1f} ms | {st['n']} | "
                     f"{f'{ratio:.2f}x' if ratio else '-'} |")
    for v, st in s.get("d_first", {}).items():
        if st:
            lines.append(f"| {v}, D's first token | {st['p50_ms']:.1f} ms | "
                         f"{st['p90_ms']:.1f} ms | {st['min_ms']:.1f} ms | {st['n']} | - |")
    lines += ["", "| difference of medians | ms | what |", "|---|---|---|"]
    for d in s["differences"]:
        ms = "-" if d["p50_ms"] is None else f"{d['p50_ms']:+.1f}"
        lines.append(f"| {d['variant']} - {d['against']} | {ms} | {d['what']} |")
    return "\n".join(lines) + "\n"


def prompts_for(variants: list[str], n: int, length: int, seed: int) -> dict[str, list]:
    """``n`` random token-id prompts per variant, none shared: a prompt sent twice would find
    its blocks in a server's prefix cache the second time."""
    every = prompts(n * len(variants), length, 400, seed)
    return {v: every[i * n:(i + 1) * n] for i, v in enumerate(variants)}


async def run_variants(urls: dict, variants: list[str], prompts: dict[str, list],
                       max_tokens: int, gap_s: float, warmup: int, seed: int = 1) -> list[dict]:
    """``warmup`` rounds, then one request per variant and round, each round in a shuffled
    order (seeded), so that each variant follows each other about equally often (a request's
    tail may weigh on the next); a failed request is recorded with its error."""
    out: list[dict] = []
    rounds = len(prompts[variants[0]])
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(rounds):
            order = list(variants)
            rng.shuffle(order)
            for v in order:
                try:
                    rec = await one(client, v, prompts[v][i], urls, max_tokens)
                    if i >= warmup:
                        out.append(rec)
                except (httpx.HTTPError, RuntimeError) as exc:
                    if i >= warmup:
                        out.append({"variant": v, "error": repr(exc)})
                await asyncio.sleep(gap_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_python_arg(ap)
    ap.add_argument("--requests", type=int, default=60, help="per variant")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--gap-s", type=float, default=0.0,
                    help="pause after each request (0: back to back, as a closed-loop client)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated, from {', '.join(VARIANTS)} (the single server "
                         "always runs)")
    ap.add_argument("--model", default="", help="model dir (default: build the tiny model)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "pd_overhead.json"))
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: from {', '.join(VARIANTS)}, got {args.variants!r}")
    work = Path(tempfile.mkdtemp(prefix="pd-overhead-"))
    model = args.model or str(build_tiny_model(REPO / ".work" / "tiny-model"))
    prompts = prompts_for(list(dict.fromkeys([*VARIANTS, *WHOLE])),
                          args.requests + args.warmup, args.prompt_len, seed=1)
    load_before = os.getloadavg()
    kv_port = free_port()
    p = vllm_server("prefill", python=args.python, model=model, port=free_port(), cpu=0,
                    log_dir=work, kv_role="kv_producer", kv_port=kv_port,
                    whole_server_on_cpu=True)
    d = vllm_server("decode", python=args.python, model=model, port=free_port(), cpu=1,
                    log_dir=work, kv_role="kv_consumer", kv_port=free_port(),
                    whole_server_on_cpu=True)
    servers = [p, d]
    try:
        p.wait_healthy()
        d.wait_healthy()
        r = router(python=args.python, port=free_port(), prefill=[(p.url, kv_port)],
                   decode=[d.url], log_dir=work,
                   extra_args=FIRST_FROM_P)
        servers.append(r)
        r.wait_healthy(60)
        urls = {"p": p.url, "d": d.url, "router": r.url, "kv_port": kv_port}
        if "router_d_core" in variants:
            # a second router bound to D's core, where P's prefill does not run
            r1 = router(python=args.python, port=free_port(), prefill=[(p.url, kv_port)],
                        decode=[d.url], log_dir=work, name="router-d-core",
                        extra_args=FIRST_FROM_P, cpu=1)
            servers.append(r1)
            r1.wait_healthy(60)
            urls["router_d_core"] = r1.url
        log(f"P/D up; {args.requests} requests per variant, interleaved")
        requests = asyncio.run(run_variants(urls, variants, prompts, args.max_tokens,
                                            args.gap_s, args.warmup))
        # where the router's clients' first tokens came from (warm-up included): P's, unless
        # the router fell back to D's (builds not read yet, D first, a mismatch)
        first_token = {path: metric(r.url, "kv_push_router_first_token_total", path=path)
                       for path in ("prefill", "decode", "mismatch")}
    except BaseException:
        d.stop()
        raise
    finally:
        for s in reversed(servers):
            if s is not d:  # D stays for the single server's run beside it
                s.stop()
    single = vllm_server("single", python=args.python, model=model, port=free_port(), cpu=0,
                         log_dir=work, whole_server_on_cpu=True)
    try:
        single.wait_healthy()
        log("single server up")
        # beside D serving plain requests on core 1 (the box as P had it), then alone
        requests += asyncio.run(run_variants(
            {"single": single.url, "d": d.url}, ["single_beside_d", "d_alone"], prompts,
            args.max_tokens, args.gap_s, args.warmup))
        d.stop()
        requests += asyncio.run(run_variants({"single": single.url}, ["single"], prompts,
                                             args.max_tokens, args.gap_s, args.warmup))
    finally:
        single.stop()
        d.stop()
    result = {"summary": summarize(requests), "requests": requests, "meta": {
        "command": " ".join(["bench_pd_overhead.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": source_commit(),
        "host": platform.node(), "cpus": os.cpu_count(), "cpu_isa": cpu_isa(), **server_dtype(),
        "requests": args.requests,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "gap_s": args.gap_s,
        "load_before": load_before, "load_after": os.getloadavg(), "logs": str(work),
        "router_first_token": first_token}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(report_md(result))
    print(report_md(result))
    log(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
