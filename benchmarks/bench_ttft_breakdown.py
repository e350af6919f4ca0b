#!/usr/bin/env python3
"""Where our TTFT goes (issue 12 item 4): TTFT of one vLLM server alone vs our P/D push at
concurrency 1, and the per-stage breakdown of the push requests from ``KV_PUSH_TIMING`` lines.

Real ``vllm serve`` (CPU build) on the suite's tiny model (block 128), started as the
end-to-end tests start them (``kv_push.common.testing.vllm_servers``): a single server and P on
core 0, D on core 1, our router in front of P and D. Requests are sequential (concurrency 1),
alternating single / push, each a streaming ``/v1/completions`` of a distinct random token-id
prompt (no prefix-cache hits) with ``ignore_eos``; TTFT is measured at the client (first
streamed chunk with a choice).

Phases (``--phases``, names from ``PHASES``): ``auto`` -- P's ``early_prefill_done=auto`` (P
announces a prefill when its step ran); ``off`` -- ``early_prefill_done=off`` (at
``request_finished``, one engine step later); ``auto-d1ms`` -- as ``auto`` with D polling every
1 ms while it awaits a WRITE (``await_poll_s=0.001``, as before that setting existed). Each phase
runs on a freshly started P (and D, when its settings change); the single server stays up. The
same prompts are used in every phase.

Every P/D component runs with ``KV_PUSH_TIMING=1``; the stage lines of each push request
(``common/timing.py`` lists them) are matched to it by the router's ``router_in`` stamp inside
the client's request window, and reported as milliseconds since the client sent the request
(median over requests), with the segments between consecutive stages.

Output: ``--out`` (JSON, every request's TTFT and stages) and the same path with ``.md``.

Usage::

    .venv/bin/python benchmarks/bench_ttft_breakdown.py                 # ~4-6 min here
    .venv/bin/python benchmarks/bench_ttft_breakdown.py --requests 10 --phases auto
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kv_push.common import timing
from kv_push.common.testing.vllm_servers import (Server, build_tiny_model, free_port, metric,
                                                 router, vllm_server)

REPO = Path(__file__).resolve().parents[1]

#: phase name -> (P's, D's kv_connector_extra_config additions)
PHASES = {
    "auto": ({"early_prefill_done": "auto"}, {}),
    "off": ({"early_prefill_done": "off"}, {}),
    "auto-d1ms": ({"early_prefill_done": "auto"}, {"await_poll_s": 0.001}),
}

#: the stages of a push request in the order it meets them (common/timing.py)
STAGES = ["client_send", "router_in", "router_legs_sent", "p_sched", "d_sched", "d_expect",
          "d_register_sent", "p_prefill_done", "p_pair", "p_write_posted", "p_write_done",
          "d_write_done", "d_recv_reported", "d_scheduled", "d_first_step_done",
          "router_first_byte", "client_first_token", "router_p_done"]
#: the critical path, segment by segment (each from the stage before it)
CRITICAL = ["client_send", "router_in", "router_legs_sent", "p_sched", "p_prefill_done",
            "p_pair", "p_write_posted", "p_write_done", "d_write_done", "d_recv_reported",
            "d_scheduled", "d_first_step_done", "router_first_byte", "client_first_token"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def one_request(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    rec: dict[str, Any] = {"t_send": time.time()}
    t0 = time.perf_counter()
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                rec["error"] = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return rec
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                if "ttft" not in rec and '"choices"' in line and '"text"' in line:
                    rec["ttft"] = time.perf_counter() - t0
                    rec["t_first"] = time.time()
        rec["e2e"] = time.perf_counter() - t0
        rec["t_end"] = time.time()
    except httpx.HTTPError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    if "ttft" not in rec and "error" not in rec:
        rec["error"] = "no token streamed"
    return rec


def stages_of(records: list[dict], req: dict) -> dict[str, float] | None:
    """The timing records of the push request ``req`` (its router_in inside its window), as
    milliseconds since the client sent it; the first stamp of each stage."""
    t_send, t_end = req["t_send"], req.get("t_end", req["t_send"] + 60)
    tids = [r["tid"] for r in records if r["stage"] == "router_in" and t_send <= r["t"] <= t_end]
    if len(tids) != 1:
        return None
    out: dict[str, float] = {"client_send": 0.0}
    for r in records:
        if r["tid"] == tids[0] and r["stage"] not in out:
            out[r["stage"]] = (r["t"] - t_send) * 1000
    if "t_first" in req:
        out["client_first_token"] = (req["t_first"] - t_send) * 1000
    how = [r.get("how") for r in records if r["tid"] == tids[0] and r["stage"] == "p_prefill_done"]
    out["_how"] = how[0] if how else None  # type: ignore[assignment]
    return out


def summarize(reqs: list[dict]) -> dict:
    ttft = [r["ttft"] * 1000 for r in reqs if "ttft" in r]
    return {"n": len(reqs), "errors": sum(1 for r in reqs if "error" in r),
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p90_ms": pct(ttft, 0.9),
            "ttft_mean_ms": statistics.fmean(ttft) if ttft else None}


def breakdown(per_req: list[dict[str, float]]) -> dict:
    at = {s: statistics.median([r[s] for r in per_req if s in r])
          for s in STAGES if any(s in r for r in per_req)}
    segs = {}
    for a, b in zip(CRITICAL, CRITICAL[1:]):
        vals = [r[b] - r[a] for r in per_req if a in r and b in r]
        if vals:
            segs[f"{a} -> {b}"] = statistics.median(vals)
    hows: dict[str, int] = {}
    for r in per_req:
        hows[str(r.get("_how"))] = hows.get(str(r.get("_how")), 0) + 1
    return {"at_ms": at, "segments_ms": segs, "announced": hows, "n": len(per_req)}


def run_phase(name: str, single: Server, p: Server, d: Server, rt: Server,
              work: list[list[int]], args: argparse.Namespace) -> dict:
    client = httpx.Client(timeout=120)
    # warm-up: a few requests each (the first request of a server is slow on CPU)
    warm = prompts(args.warmup, args.prompt_len, args.vocab, seed=99)
    for w in warm:
        for url in (single.url, rt.url):
            r = one_request(client, url, w, args.max_tokens)
            if "error" in r:
                raise RuntimeError(f"warm-up on {url} failed: {r['error']}")
    load0 = os.getloadavg()
    single_reqs, push_reqs = [], []
    for i, prompt in enumerate(work):
        order = [("single", single.url), ("push", rt.url)]
        if i % 2:
            order.reverse()
        for system, url in order:
            rec = one_request(client, url, prompt, args.max_tokens)
            (single_reqs if system == "single" else push_reqs).append(rec)
            time.sleep(args.gap_s)
    load1 = os.getloadavg()
    records = []
    for server in (rt, p, d):
        records += timing.parse(server.log_text().splitlines())
    per_req = [s for s in (stages_of(records, r) for r in push_reqs if "ttft" in r) if s]
    ext = metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    early = metric(p.url, "vllm:kv_push_prefills_announced_early_total")
    s_sum, p_sum = summarize(single_reqs), summarize(push_reqs)
    ratio = (p_sum["ttft_p50_ms"] / s_sum["ttft_p50_ms"]
             if p_sum["ttft_p50_ms"] and s_sum["ttft_p50_ms"] else None)
    ratio90 = (p_sum["ttft_p90_ms"] / s_sum["ttft_p90_ms"]
               if p_sum["ttft_p90_ms"] and s_sum["ttft_p90_ms"] else None)
    log(f"{name}: single p50 {s_sum['ttft_p50_ms']:.1f} ms, push p50 {p_sum['ttft_p50_ms']:.1f} ms "
        f"({ratio:.2f}x), p90 {s_sum['ttft_p90_ms']:.1f} vs {p_sum['ttft_p90_ms']:.1f} ms; "
        f"load {load0[0]:.2f} -> {load1[0]:.2f}")
    client.close()
    return {"phase": name, "single": s_sum, "push": p_sum,
            "ratio_p50": ratio, "ratio_p90": ratio90,
            "loadavg_before": load0, "loadavg_after": load1,
            "d_external_kv_prompt_tokens": ext, "p_prefills_announced_early": early,
            "breakdown": breakdown(per_req),
            "requests": {"single": single_reqs, "push": push_reqs, "push_stages": per_req}}


def write_md(path: Path, result: dict) -> None:
    m = result["meta"]
    lines = [
        "# TTFT breakdown: single server vs P/D push at concurrency 1",
        "",
        f"`{m['command']}` at {m['date']} (commit {m['commit']}), vLLM CPU build, tiny model "
        f"(block 128), prompt {m['prompt_len']} tokens, {m['max_tokens']} output tokens, "
        f"{m['requests']} requests per system and phase, alternating; {m['cpus']} cores "
        "shared with other work (load averages below).",
        "",
        "| phase | single p50 | single p90 | push p50 | push p90 | p50 ratio | "
        "p90 ratio | load (1 min) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def f(v):
        return "-" if v is None else f"{v:.1f}"
    for ph in result["phases"]:
        s, p = ph["single"], ph["push"]
        lines.append(f"| `{ph['phase']}` | {f(s['ttft_p50_ms'])} ms | "
                     f"{f(s['ttft_p90_ms'])} ms | {f(p['ttft_p50_ms'])} ms | "
                     f"{f(p['ttft_p90_ms'])} ms | {ph['ratio_p50']:.2f}x | "
                     f"{ph['ratio_p90']:.2f}x | {ph['loadavg_before'][0]:.2f} -> "
                     f"{ph['loadavg_after'][0]:.2f} |")
    lines += ["", "Phases (P's / D's `kv_connector_extra_config` additions): " + "; ".join(
        f"`{ph['phase']}`: P {json.dumps(ph.get('p_config', {}))}, D "
        f"{json.dumps(ph.get('d_config', {}))}" for ph in result["phases"]) + ". "
        "P prefills announced early (P's counter): " + ", ".join(
        f"`{ph['phase']}` {ph['p_prefills_announced_early']:.0f}" for ph in result["phases"]) + "."]
    lines += ["", "## Push: stage reached, ms after the client sent the request (median)", ""]
    names = [ph["phase"] for ph in result["phases"]]
    lines.append("| stage | " + " | ".join(f"`{n}`" for n in names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for st in STAGES:
        vals = [ph["breakdown"]["at_ms"].get(st) for ph in result["phases"]]
        if any(v is not None for v in vals):
            lines.append(f"| {st} | " + " | ".join(f(v) for v in vals) + " |")
    lines += ["", "## Push: critical path, segment medians (ms)", ""]
    lines.append("| segment | " + " | ".join(f"`{n}`" for n in names) + " |")
    lines.append("|---|" + "---|" * len(names))
    segs = [a + " -> " + b for a, b in zip(CRITICAL, CRITICAL[1:])]
    for sg in segs:
        vals = [ph["breakdown"]["segments_ms"].get(sg) for ph in result["phases"]]
        if any(v is not None for v in vals):
            lines.append(f"| {sg} | " + " | ".join(f(v) for v in vals) + " |")
    lines += ["", "How P announced each prefill (`p_prefill_done`'s `how`): " + "; ".join(
        f"`{ph['phase']}`: {ph['breakdown']['announced']}"
        for ph in result["phases"]), ""]
    if m.get("notes"):
        lines += ["Notes: " + m["notes"], ""]
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20, help="per system and phase")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=400, help="token ids drawn below this (the tiny model has 462)")
    ap.add_argument("--gap-s", type=float, default=0.05, help="pause between requests")
    ap.add_argument("--phases", default="auto,off,auto-d1ms",
                    help=f"comma-separated, from {sorted(PHASES)}")
    ap.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "ttft_breakdown.json"))
    ap.add_argument("--log-dir", default="")
    ap.add_argument("--extra-config", default="{}",
                    help="JSON merged into P's and D's kv_connector_extra_config")
    ap.add_argument("--notes", default="")
    args = ap.parse_args()

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="ttft-breakdown-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(REPO / ".work" / "tiny-model")
    extra = json.loads(args.extra_config)
    env = {timing.ENV: "1"}
    work = prompts(args.requests, args.prompt_len, args.vocab, seed=1234)
    servers: list[Server] = []
    phases = []

    def start(name: str, cpu: int, role: str, cfg: dict) -> tuple[Server, int]:
        kv = free_port()
        srv = vllm_server(name, python=args.python, model=str(model), port=free_port(),
                          cpu=cpu, log_dir=log_dir, kv_role=role, kv_port=kv,
                          extra_config={**extra, **cfg}, extra_env=env, max_model_len=1024)
        servers.append(srv)
        return srv, kv

    def stop(srv: Server) -> None:
        srv.stop()
        servers.remove(srv)

    try:
        single = vllm_server("single", python=args.python, model=str(model), port=free_port(),
                             cpu=0, log_dir=log_dir, max_model_len=1024)
        servers.append(single)
        fresh = [single]
        d, d_cfg = None, None
        for setting in args.phases.split(","):
            p_cfg, want_d = PHASES[setting]
            if d is None or want_d != d_cfg:
                if d is not None:
                    stop(d)
                d, _ = start(f"d-{setting}", 1, "kv_consumer", want_d)
                d_cfg = want_d
                fresh.append(d)
            p, p_kv = start(f"p-{setting}", 0, "kv_producer", p_cfg)
            rt = router(python=args.python, port=free_port(), prefill=[(p.url, p_kv)],
                        decode=[d.url], log_dir=log_dir, name=f"router-{setting}",
                        extra_env=env)
            servers.append(rt)
            for s in fresh + [p, rt]:
                s.wait_healthy(300)
            fresh = []
            log(f"phase {setting}: servers up (logs in {log_dir})")
            phases.append(run_phase(setting, single, p, d, rt, work, args))
            phases[-1].update(p_config=p_cfg, d_config=want_d)
            stop(rt)
            stop(p)
    finally:
        for s in list(servers):
            s.stop()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    result = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "commit": commit, "command": " ".join(["bench_ttft_breakdown.py",
                                                              *sys.argv[1:]]),
                       "host": platform.node(), "cpus": os.cpu_count(),
                       "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                       "requests": args.requests, "extra_config": extra, "notes": args.notes,
                       "log_dir": str(log_dir)},
              "phases": phases}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    write_md(out.with_suffix(".md"), result)
    log(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
