#!/usr/bin/env python3
"""Where our TTFT goes (issue 12 item 4): TTFT of one vLLM server alone vs our P/D push at
concurrency 1, and the per-stage breakdown of the push requests from ``KV_PUSH_TIMING`` lines.

Real ``vllm serve`` (CPU build) on the suite's tiny model (block 128), started as the
end-to-end tests start them (``kv_push.common.testing.vllm_servers``): a single server and every
P on core 0, every D on core 1, one of our routers in front of each (P, D) system. Requests go
one at a time (concurrency 1), each a streaming ``/v1/completions`` of a distinct random
token-id prompt (no prefix-cache hits) with ``ignore_eos``, each prompt to the single server and
to every system of the group, the order rotating by one per prompt; TTFT is measured at the
client (first streamed chunk with a choice).

Groups (``--groups``, from ``GROUPS``), each on its own freshly started P and D servers (the
single server stays up), their systems side by side so that load drift weighs on all alike.
The systems of a group share a P or a D, so each system's requests carry their own
``cache_salt`` (``--salt``, the default since 2026-12-04; earlier results were taken without
it, and the second system to send a prompt found it in the shared server's prefix cache). The
salt names the group too (since 2026-12-04 19:00): every group sends the same prompts, and the
single server, which stays up, found them in its prefix cache in every group after the first
(the "single server gets faster in later groups" of earlier runs):

* ``early``: ``early_prefill_done=auto`` (P announces a prefill when its step ran) against
  ``off`` (at ``request_finished``, one engine step later), one D;
* ``poll``: one P (``auto``), D polling every 0.2 ms while it awaits a WRITE
  (``await_poll_s`` default) against every 1 ms (``await_poll_s=0.001``: as before it existed);
* ``idle``: one P, D waiting up to ``idle_step_wait_s`` (default) in an engine step that runs no
  model for the WRITE's outcome, against not waiting (``0``: the outcome is reported at the next
  step's look, as before the setting existed);
* ``first``: one P and one D behind two routers, the client's first token taken from P's leg
  (the router's ``--first-token-from-prefill auto``) against from D's stream (``off``, the
  router's default).
* ``prefill_poll``: two P and one D, the first token from P: P's transfer thread backing off
  while a registration waits for its prefill (``prefill_wait_poll_s`` default) against polling
  NIXL every ``idle_poll_s`` through the prefill (``0.001``: as before the setting existed).

``--burst N`` sends each system N requests back to back (each when the previous one ended, as a
closed-loop client at concurrency 1 does, e.g. ``bench_serving.py``'s concurrency-1 point)
before the gap and the next system.

Measuring on a small box (2 cores here; ``--pin``, ``--gap-s``, as of 2026-12-04 16:00):

* each server's every process (API server, engine core, worker) runs on its core
  (``--pin server``): with only the workers pinned, the single server's API process had the
  other core to itself while P's and D's shared both with two workers and each other, and D's
  engine, which steps every millisecond while a request waits for its KV, slowed P down --
  costs of sharing one box, not of P/D (P and D run on machines of their own);
* requests are 1.2 s apart (``--gap-s``): a vLLM worker busy-polls its queue for 1 s after
  each step (``shm_broadcast.SpinCondition``), so with short gaps the system served last
  slowed down the next one on the same core (the single server shares core 0 with P);
* the servers run in the bench's session (``vllm_servers.Server``): in sessions of their own,
  the kernel's autogroup scheduling made a woken API process wait 50-350 ms for a core.

Every P/D component runs with ``KV_PUSH_TIMING=1``; the stage lines of each push request
(``common/timing.py`` lists them) are matched to it by the router's ``router_in`` stamp inside
the client's request window, and reported as milliseconds since the client sent the request
(median over requests), with the segments between consecutive stages.

Around each request the bench also reads how long the client's, the router's and each server's
threads were runnable but had no core (``/proc/<pid>/task/<tid>/schedstat``, the kernel's run
delay): on this box P's and D's cores are busy while a push request runs, and the router and the
client get only what is left, where the single server's client has the other core to itself.

Output: ``--out`` (JSON, every request's TTFT and stages) and the same path with ``.md``.

Usage::

    .venv/bin/python benchmarks/bench_ttft_breakdown.py                 # ~8-10 min here
    .venv/bin/python benchmarks/bench_ttft_breakdown.py --requests 10 --groups early
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench_meta import add_python_arg, source_commit
from kv_push.common import timing
from kv_push.common.testing.sse_lines import sse_lines
from kv_push.common.testing.vllm_servers import (Server, build_tiny_model, free_port, metric,
                                                 metric_in, router, vllm_server)

REPO = Path(__file__).resolve().parents[1]

#: the router's arguments that take the client's first token from P
FIRST_FROM_P = ["--first-token-from-prefill", "auto"]

#: group -> the P and D servers it starts (name -> their kv_connector_extra_config additions)
#: and its systems (name -> (P, D) behind one router); a group's systems run side by side
GROUPS = {
    "early": {"p": {"p-early-auto": {"early_prefill_done": "auto"},
                    "p-early-off": {"early_prefill_done": "off"}},
              "d": {"d": {}},
              "systems": {"push early=auto": ("p-early-auto", "d"),
                          "push early=off": ("p-early-off", "d")}},
    # one P and one D behind two routers: the client's first token from P
    # (--first-token-from-prefill auto) against from D (off, the router's default)
    "first": {"p": {"p": {}}, "d": {"d": {}},
              "systems": {"push first-token=prefill": ("p", "d"),
                          "push first-token=decode": ("p", "d")},
              "router_args": {"push first-token=prefill": FIRST_FROM_P}},
    "poll": {"p": {"p": {"early_prefill_done": "auto"}},
             "d": {"d-await-0.2ms": {}, "d-await-1ms": {"await_poll_s": 0.001}},
             "systems": {"push await_poll_s=0.0002": ("p", "d-await-0.2ms"),
                         "push await_poll_s=0.001": ("p", "d-await-1ms")}},
    # one P, D waiting in a step that runs no model for the WRITE's outcome (idle_step_wait_s
    # default) against not waiting (0: reported at the next step's look, as before it existed)
    "idle": {"p": {"p": {}},
             "d": {"d-idle-wait": {}, "d-no-idle-wait": {"idle_step_wait_s": 0}},
             "systems": {"push idle_step_wait_s=0.002": ("p", "d-idle-wait"),
                         "push idle_step_wait_s=0": ("p", "d-no-idle-wait")}},
    # one P, two D, the first token from P: D waiting for the WRITE as it does by default
    # against a D that polls every 1 ms and does not wait in a step that runs no model (less of
    # the CPU the router and the client share with D on a small box)
    "first_dquiet": {"p": {"p": {}},
                     "d": {"d": {}, "d-quiet": {"idle_step_wait_s": 0, "await_poll_s": 0.001}},
                     "systems": {"push first-token=prefill": ("p", "d"),
                                 "push first-token=prefill d-quiet": ("p", "d-quiet")},
                     "router_args": {"push first-token=prefill": FIRST_FROM_P,
                                     "push first-token=prefill d-quiet": FIRST_FROM_P}},
    # two P, one D, the first token from P: P's thread backing off while a registration waits
    # for its prefill (prefill_wait_poll_s default) against polling NIXL every idle_poll_s
    # through the prefill (as before the setting existed)
    "prefill_poll": {"p": {"p-backoff": {}, "p-poll": {"prefill_wait_poll_s": 0.001}},
                     "d": {"d": {}},
                     "systems": {"push prefill_wait_poll_s=0.02": ("p-backoff", "d"),
                                 "push prefill_wait_poll_s=0.001": ("p-poll", "d")},
                     "router_args": {"push prefill_wait_poll_s=0.02": FIRST_FROM_P,
                                     "push prefill_wait_poll_s=0.001": FIRST_FROM_P}},
}

#: the stages of a push request in the order it meets them (common/timing.py)
STAGES = ["client_send", "router_in", "router_legs_sent", "p_sched", "d_sched", "d_expect",
          "d_register_sent", "p_prefill_done", "p_pair", "p_write_posted", "p_write_done",
          "d_write_done", "d_recv_reported", "d_scheduled", "d_first_step_done",
          "router_first_byte", "client_first_token", "p_step_output", "router_p_done"]
#: the critical path, segment by segment (each from the stage before it)
CRITICAL = ["client_send", "router_in", "router_legs_sent", "p_sched", "p_prefill_done",
            "p_pair", "p_write_posted", "p_write_done", "d_write_done", "d_recv_reported",
            "d_scheduled", "d_first_step_done", "router_first_byte", "client_first_token"]
#: the segments reported: the critical path, then P's answer's path (the client's first token
#: when it comes from P: router's ``--first-token-from-prefill``)
SEGMENTS = list(zip(CRITICAL, CRITICAL[1:])) + [
    ("p_sched", "p_step_output"), ("p_prefill_done", "p_step_output"),
    ("p_step_output", "router_p_done"),
    ("router_p_done", "router_first_byte")]


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


def one_request(client: httpx.Client, url: str, prompt: list[int], max_tokens: int,
                salt: str | None = None, on_first: Any = None) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    if salt is not None:  # a prefix cache of its own per system (a P or D may serve several)
        body["cache_salt"] = salt
    rec: dict[str, Any] = {"t_send": time.time()}
    t0 = time.perf_counter()
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                rec["error"] = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return rec
            chunks, t_last = 0, 0.0
            for line in sse_lines(resp.iter_bytes()):
                if not (line.startswith("data: {") and '"choices"' in line
                        and '"text"' in line):
                    continue  # not a token's event
                chunks, t_last = chunks + 1, time.perf_counter() - t0
                if chunks == 1:
                    rec["ttft"] = t_last
                    rec["t_first"] = time.time()
                    if on_first is not None:
                        on_first(rec)
                elif chunks == 2:  # the first gap: with the first token from P, the
                    rec["gap1"] = t_last - rec["ttft"]  # transfer and two of D's steps
            if chunks > 1:  # one decode step per later token (each streamed as it comes)
                rec["itl"] = (t_last - rec["ttft"]) / (chunks - 1)
        rec["e2e"] = time.perf_counter() - t0
        rec["t_end"] = time.time()
    except httpx.HTTPError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    if "ttft" not in rec and "error" not in rec:
        rec["error"] = "no token streamed"
    return rec


def cpu_waits(pids: list[int]) -> dict[int, int]:
    """Per thread of ``pids``, the time it has spent runnable but waiting for a CPU (the
    kernel's ``schedstat`` run delay, ns)."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    out[int(tid)] = int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def waited_ms(before: dict[int, int], after: dict[int, int]) -> float:
    """The threads' CPU wait between two readings (a thread started in between counts whole;
    one that ended in between is lost)."""
    return sum(v - before.get(t, 0) for t, v in after.items()) / 1e6


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
    first = [r.get("source", "decode") for r in records
             if r["tid"] == tids[0] and r["stage"] == "router_first_byte"]
    out["_first_from"] = first[0] if first else None  # type: ignore[assignment]
    return out


def summarize(reqs: list[dict]) -> dict:
    ttft = [r["ttft"] * 1000 for r in reqs if "ttft" in r]
    itl = [r["itl"] * 1000 for r in reqs if "itl" in r]

    def waits(field: str) -> dict[str, float]:
        roles = {role for r in reqs for role in r.get(field, {})}
        return {role: statistics.median(r[field][role] for r in reqs if role in r.get(field, {}))
                for role in sorted(roles)}
    return {"cpu_wait_p50_ms": waits("cpu_wait_ms"),
            "cpu_wait_first_p50_ms": waits("cpu_wait_first_ms"),
            "n": len(reqs), "errors": sum(1 for r in reqs if "error" in r),
            "ttft_min_ms": min(ttft) if ttft else None, "ttft_p25_ms": pct(ttft, 0.25),
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p90_ms": pct(ttft, 0.9),
            "ttft_mean_ms": statistics.fmean(ttft) if ttft else None,
            "itl_p50_ms": pct(itl, 0.5)}


def breakdown(per_req: list[dict[str, float]]) -> dict:
    at = {s: statistics.median([r[s] for r in per_req if s in r])
          for s in STAGES if any(s in r for r in per_req)}
    segs = {}
    for a, b in SEGMENTS:
        vals = [r[b] - r[a] for r in per_req if a in r and b in r]
        if vals:
            segs[f"{a} -> {b}"] = statistics.median(vals)
    hows = collections.Counter(str(r.get("_how")) for r in per_req)
    first = collections.Counter(str(r.get("_first_from")) for r in per_req)
    return {"at_ms": at, "segments_ms": segs, "announced": dict(hows),
            "first_token_from": dict(first), "n": len(per_req)}


def rel(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


#: vLLM's own per-request histograms read from each server's /metrics around the measured
#: requests (means: sum / count), to compare P with the single server from the inside
VLLM_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",  # API process: arrival to the first token
    "queue": "vllm:request_queue_time_seconds",  # engine: arrival to scheduled
    "prefill": "vllm:request_prefill_time_seconds",  # engine: scheduled to the first token
}


def vllm_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of :data:`VLLM_HISTOGRAMS` on the server at ``url`` (one read)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {k: (metric_in(text, name + "_sum"), metric_in(text, name + "_count"))
            for k, name in VLLM_HISTOGRAMS.items()}


def vllm_means_ms(before: dict, after: dict) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k in VLLM_HISTOGRAMS:
        n = after[k][1] - before[k][1]
        out[k] = (after[k][0] - before[k][0]) / n * 1000 if n > 0 else None
    out["n"] = after["ttft"][1] - before["ttft"][1]
    return out


def run_group(name: str, group: dict, single: Server, ps: dict[str, Server],
              ds: dict[str, Server], routers: dict[str, Server], work: list[list[int]],
              args: argparse.Namespace) -> dict:
    """Requests of ``work`` one at a time, each prompt to the single server and to every system
    of the group, the order rotating by one per prompt."""
    client = httpx.Client(timeout=120)
    urls = {"single": single.url, **{sys_: routers[sys_].url for sys_ in group["systems"]}}
    warm = prompts(args.warmup, args.prompt_len, args.vocab, seed=99)
    for w in warm:  # the first requests of a server are slow on CPU
        for url in urls.values():
            r = one_request(client, url, w, args.max_tokens)
            if "error" in r:
                raise RuntimeError(f"warm-up on {url} failed: {r['error']}")
    # whose CPU waits are read around each request (the client: this process)
    watch = {"single": {"client": [os.getpid()], "server": single.pids()}}
    for sys_, (p_name, d_name) in group["systems"].items():
        watch[sys_] = {"client": [os.getpid()],
                       "router": routers[sys_].pids(),
                       "p": ps[p_name].pids(),
                       "d": ds[d_name].pids()}
    hits0 = metric(single.url, "vllm:prefix_cache_hits_total")
    inside = {"single": single.url, **{f"P {n}": srv.url for n, srv in ps.items()}}
    sums0 = {k: vllm_sums(url) for k, url in inside.items()}
    load0 = os.getloadavg()
    reqs: dict[str, list[dict]] = {k: [] for k in urls}
    names = list(urls)
    for i in range(0, len(work), args.burst):
        k = (i // args.burst) % len(names)
        for system in names[k:] + names[:k]:
            for j, prompt in enumerate(work[i:i + args.burst]):
                # servers first, the client last: the bench's own reading stays out of the
                # client's and the router's windows as far as it can
                roles = sorted(watch[system], key=("p", "d", "server", "router", "client").index)
                before = {role: cpu_waits(watch[system][role]) for role in roles}

                def at_first(rec: dict, system: str = system, before: dict = before) -> None:
                    # the client's and the router's waits up to the first token (a few
                    # threads: quick to read; the servers' many threads are read at the end)
                    rec["cpu_wait_first_ms"] = {
                        role: waited_ms(before[role], cpu_waits(watch[system][role]))
                        for role in ("client", "router") if role in watch[system]}

                rec = one_request(client, urls[system], prompt, args.max_tokens,
                                  f"{name}:{system}" if args.salt else None, at_first)
                rec["cpu_wait_ms"] = {role: waited_ms(before[role],
                                                      cpu_waits(watch[system][role]))
                                      for role in roles}
                rec["in_burst"] = j  # 0: after a gap; > 0: right after the previous one ended
                reqs[system].append(rec)
            time.sleep(args.gap_s)
    load1 = os.getloadavg()
    client.close()
    # prompt tokens the single server found in its prefix cache during the measured requests
    # (must be 0: every group sends the same prompts, so its salt names the group too)
    single_hits = metric(single.url, "vllm:prefix_cache_hits_total") - hits0
    vllm_inside = {k: vllm_means_ms(sums0[k], vllm_sums(url)) for k, url in inside.items()}
    records = []
    for server in [*routers.values(), *ps.values(), *ds.values()]:
        records += timing.parse(server.log_text().splitlines())
    single_sum = summarize(reqs["single"])
    out = {"group": name, "loadavg_before": load0, "loadavg_after": load1,
           "threads": {sys_: {role: len(cpu_waits(pids)) for role, pids in w.items()}
                       for sys_, w in watch.items()},
           "single": single_sum, "single_requests": reqs["single"],
           "single_prefix_cache_hit_tokens": single_hits, "vllm_inside_ms": vllm_inside,
           "systems": []}
    for system, (p_name, d_name) in group["systems"].items():
        per_req = [st for st in (stages_of(records, r) for r in reqs[system] if "ttft" in r) if st]
        summ = summarize(reqs[system])
        out["systems"].append({
            "system": system, "p": p_name, "d": d_name,
            "p_config": group["p"][p_name], "d_config": group["d"][d_name], "push": summ,
            "ratio_p50": rel(summ["ttft_p50_ms"], single_sum["ttft_p50_ms"]),
            "ratio_p90": rel(summ["ttft_p90_ms"], single_sum["ttft_p90_ms"]),
            "breakdown": breakdown(per_req), "requests": reqs[system], "stages": per_req})
    for sys_ in out["systems"]:
        log(f"{name} / {sys_['system']}: single p50 {single_sum['ttft_p50_ms']:.1f} ms, "
            f"push p50 {sys_['push']['ttft_p50_ms']:.1f} ms ({sys_['ratio_p50']:.2f}x), p90 "
            f"{single_sum['ttft_p90_ms']:.1f} vs {sys_['push']['ttft_p90_ms']:.1f} ms")
    log(f"{name}: load {load0[0]:.2f} -> {load1[0]:.2f}")
    out["p_prefills_announced_early"] = {
        n: metric(srv.url, "vllm:kv_push_prefills_announced_early_total") for n, srv in ps.items()}
    out["d_external_kv_prompt_tokens"] = {
        n: metric(srv.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        for n, srv in ds.items()}
    out["d_local_compute_prompt_tokens"] = {
        n: metric(srv.url, "vllm:prompt_tokens_by_source_total", source="local_compute")
        for n, srv in ds.items()}
    return out


def f1(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _p50_ms(reqs: list[dict], key: str) -> float | None:
    return pct([r[key] * 1000 for r in reqs if r.get(key) is not None], 0.5)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{f1(v)} ms"


def write_md(path: Path, result: dict) -> None:
    m = result["meta"]
    lines = [
        "# TTFT breakdown: single server vs P/D push at concurrency 1",
        "",
        f"`{m['command']}` at {m['date']} ({m['notes'] or 'commit ' + m['commit']}), vLLM CPU "
        f"build, tiny model (block 128), prompt {m['prompt_len']} tokens, {m['max_tokens']} "
        f"output tokens (streamed), {m['requests']} requests per system, one at a time, "
        + (f"each prompt to every system of its group in rotating order, "
           f"{m.get('gap_s', 0.05)} s apart; " if m.get("burst", 1) == 1 else
           f"{m['burst']} prompts to each system of its group back to back (each sent when the "
           "previous one ended, as a closed-loop client at concurrency 1), the systems in "
           f"rotating order, {m.get('gap_s', 0.05)} s apart; ")
        + ("each server's every process on its core (`--pin server`)"
           if m.get("pin") == "server" else "only the servers' workers pinned") +
        (f"; the routers' threads at nice {m['router_nice']}" if m.get("router_nice") else "")
        + f". {m['cpus']} cores: see the load averages.",
        "",
        "| group | system | single p50 | push p50 | p50 ratio | single p90 | push p90 | "
        "p90 ratio | single p25 / min | push p25 / min | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in result["groups"]:
        s = g["single"]
        for sy in g["systems"]:
            p = sy["push"]
            lines.append(
                f"| {g['group']} | {sy['system']} | {f1(s['ttft_p50_ms'])} ms | "
                f"{f1(p['ttft_p50_ms'])} ms | {sy['ratio_p50']:.2f}x | {f1(s['ttft_p90_ms'])} ms "
                f"| {f1(p['ttft_p90_ms'])} ms | {sy['ratio_p90']:.2f}x | "
                f"{f1(s['ttft_p25_ms'])} / {f1(s['ttft_min_ms'])} ms | "
                f"{f1(p['ttft_p25_ms'])} / {f1(p['ttft_min_ms'])} ms | "
                f"{g['loadavg_before'][0]:.1f} -> {g['loadavg_after'][0]:.1f} |")
    lines += ["", "## The floor: one decode step more than a single server", "",
              "A single server samples the first token in its prefill step. In vLLM's P/D, D "
              "gets the KV of the prompt and computes its last token again (one token: a "
              "decode-sized step) to sample the first token itself; P's own first token is "
              "thrown away unless the router sends it (`--first-token-from-prefill auto`). So "
              "a P/D request whose first token comes from D cannot beat the single server's "
              "TTFT plus one decode step of the same vLLM, measured here as the single "
              "server's inter-token latency (ITL: the gaps between its streamed tokens, p50). "
              "What is left above that floor is the transfer, D's noticing the KV and "
              "scheduling the request, and the router.", "",
              "| group | system | single TTFT p50 | single ITL p50 | floor | push p50 | "
              "push - floor | push / floor |", "|---|---|---|---|---|---|---|---|"]
    for g in result["groups"]:
        s = g["single"]
        for sy in g["systems"]:
            p = sy["push"]
            # the floor is D's: leave out systems whose clients got most first tokens from P
            got = sy["breakdown"].get("first_token_from", {})
            from_p = got.get("prefill", 0) > sum(got.values()) / 2
            if s.get("itl_p50_ms") is None or s.get("ttft_p50_ms") is None or from_p:
                continue
            floor = s["ttft_p50_ms"] + s["itl_p50_ms"]
            lines.append(f"| {g['group']} | {sy['system']} | {f1(s['ttft_p50_ms'])} ms | "
                         f"{f1(s['itl_p50_ms'])} ms | {f1(floor)} ms | {f1(p['ttft_p50_ms'])} ms "
                         f"| {f1(p['ttft_p50_ms'] - floor)} ms | "
                         f"{p['ttft_p50_ms'] / floor:.2f}x |")
    systems = [(g, sy) for g in result["groups"] for sy in g["systems"]]
    lines += ["", "Systems (P's / D's `kv_connector_extra_config` additions): " + "; ".join(
        f"{sy['system']}: P {json.dumps(sy['p_config'])}, D {json.dumps(sy['d_config'])}"
        for _, sy in systems) + ". P prefills announced early (P's counter, warm-up "
        "included): " + "; ".join(f"{g['group']}: {g['p_prefills_announced_early']}"
                                  for g in result["groups"]) + ". Prompt tokens D computed "
        "itself (must be 0): " + "; ".join(f"{g['group']}: {g['d_local_compute_prompt_tokens']}"
                                           for g in result["groups"]) + ". Prompt tokens the "
        "single server found in its prefix cache (must be 0): " + "; ".join(
            f"{g['group']}: {g.get('single_prefix_cache_hit_tokens', '-')}"
            for g in result["groups"]) + "."]
    lines += ["", "## After the first token", "",
              "p50 over requests, from the requests in the JSON: the client's first gap (its "
              "first token to its second; recorded since 2026-12-05 21:30, `-` before), its "
              "mean gap between streamed tokens, and its whole response (sent to last byte). "
              "With the first token from P, the client's second token is D's second sampled "
              "token (the router drops D's copy of the first): the first gap then carries the "
              "transfer and two of D's steps.", "",
              "| group | system | single first gap | push first gap | single mean gap | "
              "push mean gap | single response | push response |",
              "|---|---|---|---|---|---|---|---|"]
    for g in result["groups"]:
        single = g.get("single_requests") or []
        for sy in g["systems"]:
            reqs = sy.get("requests") or []
            lines.append(f"| {g['group']} | {sy['system']} | " + " | ".join(
                _ms(_p50_ms(rs, key)) for key in ("gap1", "itl", "e2e")
                for rs in (single, reqs)) + " |")
    head = "| stage | " + " | ".join(sy["system"] for _, sy in systems) + " |"
    rule = "|---|" + "---|" * len(systems)
    lines += ["", "## Push: stage reached, ms after the client sent the request (median)", "",
              head, rule]
    for st in STAGES:
        vals = [sy["breakdown"]["at_ms"].get(st) for _, sy in systems]
        if any(v is not None for v in vals):
            lines.append(f"| {st} | " + " | ".join(f1(v) for v in vals) + " |")
    lines += ["", "## Push: critical path, then P's answer's path, segment medians (ms)", "", head.replace("stage",
                                                                                 "segment"), rule]
    for a, b in SEGMENTS:
        sg = f"{a} -> {b}"
        vals = [sy["breakdown"]["segments_ms"].get(sg) for _, sy in systems]
        if any(v is not None for v in vals):
            lines.append(f"| {sg} | " + " | ".join(f1(v) for v in vals) + " |")
    lines += ["", "## Waiting for a CPU during a request (ms, median)", "",
              "Per request, what each process's threads spent runnable but without a core "
              "(the kernel's schedstat run delay, summed over the threads, read before the "
              "request and after its last byte; the client is the bench process). Threads "
              "per process group: " + "; ".join(
                  f"{g['group']}: {g.get('threads')}" for g in result["groups"]) + ".", "",
              "| group | system | client, to the first token | router, to the first token | "
              "client | single server | router | P | D |", "|---|---|" + "---|" * 7]
    for g in result["groups"]:
        rows = [("single", g["single"])] + [(sy["system"], sy["push"]) for sy in g["systems"]]
        for name, summ in rows:
            w, w1 = summ.get("cpu_wait_p50_ms", {}), summ.get("cpu_wait_first_p50_ms", {})
            lines.append(f"| {g['group']} | {name} | " + " | ".join(
                [f"{w1[k]:.2f}" if k in w1 else "-" for k in ("client", "router")] +
                [f"{w[k]:.2f}" if k in w else "-"
                 for k in ("client", "server", "router", "p", "d")]) + " |")
    lines += ["", "## The servers' own view (vLLM's histograms, means over the measured "
              "requests)", "",
              "What vLLM itself measured in the single server and in P, from its "
              "`/metrics` before and after the measured requests: `ttft` is "
              "`vllm:time_to_first_token_seconds` (the API process: the request's arrival to "
              "its first token there), `queue` and `prefill` the engine's "
              "`request_queue_time` (arrival to scheduled) and `request_prefill_time` "
              "(scheduled to the first token). P serves every push system of its group.", "",
              "| group | server | requests | ttft | queue | prefill |", "|---|---|---|---|---|---|"]
    for g in result["groups"]:
        for srv, m in (g.get("vllm_inside_ms") or {}).items():
            lines.append(f"| {g['group']} | {srv} | {m['n']:.0f} | {f1(m['ttft'])} ms | "
                         f"{f1(m['queue'])} ms | {f1(m['prefill'])} ms |")
    lines += ["", "How P announced each measured prefill (`p_prefill_done`'s `how`): " + "; ".join(
        f"{sy['system']}: {sy['breakdown']['announced']}" for _, sy in systems) + ". Where the "
        "client's first token came from (the router's `router_first_byte` stamp): " + "; ".join(
        f"{sy['system']}: {sy['breakdown'].get('first_token_from')}" for _, sy in systems) + ".",
        ""]
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20, help="per system and phase")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=400,
                    help="token ids drawn below this (the tiny model has 462)")
    ap.add_argument("--gap-s", type=float, default=1.2,
                    help="pause between requests: over 1 s, so every vLLM worker has stopped "
                    "busy-polling (it polls its queue for 1 s after each step) before the next "
                    "request starts (runs before 2026-12-04 16:00 used 0.05)")
    ap.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True,
                    help="P, D and the routers write their stage lines (the breakdown); "
                    "--no-timing: TTFT only, without the stamps' own cost (a log line each)")
    ap.add_argument("--pin", choices=("server", "worker"), default="server",
                    help="server: each server's every process (API server, engine core, "
                    "worker) on its core, as on a machine of its own; worker: only the worker "
                    "(as before 2026-12-04 16:00: the single server's API process then had the "
                    "other core to itself, P's and D's shared both)")
    ap.add_argument("--groups", default="first,early,poll",
                    help=f"comma-separated, from {sorted(GROUPS)}")
    ap.add_argument("--salt", action=argparse.BooleanOptionalAction, default=True,
                    help="each system's requests carry their own cache_salt: systems sharing a "
                    "P or a D (every group here) would otherwise meet each prompt a second time "
                    "in that server's prefix cache (--no-salt: as runs before 2026-12-04)")
    ap.add_argument("--burst", type=int, default=1,
                    help="requests each system gets one right after the other (as a closed-"
                         "loop client at concurrency 1 sends them: bench_serving.py's conc1 "
                         "point) before --gap-s and the next system; 1: every request after a "
                         "gap")
    ap.add_argument("--router-nice", type=int, default=0,
                    help="nice value of the routers' threads (e.g. -10, as root): on a box where "
                    "P's and D's cores are busy while a request runs, how much of the P/D "
                    "overhead is the router waiting for a CPU (a router on a core of its own "
                    "does not wait); 0: as started")
    add_python_arg(ap)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "ttft_breakdown.json"),
                    help="JSON (and .md beside it); the default overwrites the committed result")
    ap.add_argument("--log-dir", default="")
    ap.add_argument("--extra-config", default="{}",
                    help="JSON merged into P's and D's kv_connector_extra_config")
    ap.add_argument("--notes", default="")
    ap.add_argument("--report", metavar="JSON", default=None,
                    help="write the .md of a result JSON again (no servers started; a note "
                    "added by hand to the old .md is not kept)")
    args = ap.parse_args()
    if args.report:
        path = Path(args.report)
        write_md(path.with_suffix(".md"), json.loads(path.read_text()))
        return
    if args.burst < 1:
        ap.error("--burst must be at least 1")

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="ttft-breakdown-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(REPO / ".work" / "tiny-model")
    extra = json.loads(args.extra_config)
    env = {timing.ENV: "1"} if args.timing else {}
    work = prompts(args.requests, args.prompt_len, args.vocab, seed=1234)
    servers: list[Server] = []
    groups: list[dict] = []

    def start(name: str, cpu: int, role: str, cfg: dict) -> tuple[Server, int]:
        kv = free_port()
        srv = vllm_server(name, python=args.python, model=str(model), port=free_port(),
                          cpu=cpu, log_dir=log_dir, kv_role=role, kv_port=kv,
                          extra_config={**extra, **cfg}, extra_env=env, max_model_len=1024,
                          whole_server_on_cpu=args.pin == "server")
        servers.append(srv)
        return srv, kv

    try:
        single = vllm_server("single", python=args.python, model=str(model), port=free_port(),
                             cpu=0, log_dir=log_dir, max_model_len=1024,
                             whole_server_on_cpu=args.pin == "server")
        servers.append(single)
        fresh = [single]
        for gname in args.groups.split(","):
            group = GROUPS[gname]
            ps = {n: start(f"{gname}-{n}", 0, "kv_producer", cfg) for n, cfg in group["p"].items()}
            ds = {n: start(f"{gname}-{n}", 1, "kv_consumer", cfg)[0]
                  for n, cfg in group["d"].items()}
            routers = {}
            for i, (system, (p_name, d_name)) in enumerate(group["systems"].items()):
                p, p_kv = ps[p_name]
                routers[system] = router(python=args.python, port=free_port(),
                                         prefill=[(p.url, p_kv)], decode=[ds[d_name].url],
                                         log_dir=log_dir, name=f"{gname}-router{i}",
                                         extra_env=env,
                                         extra_args=group.get("router_args", {}).get(system))
                servers.append(routers[system])
            group_servers = [*(p for p, _ in ps.values()), *ds.values(), *routers.values()]
            for srv in fresh + group_servers:
                srv.wait_healthy(300)
            if args.router_nice:
                for r in routers.values():
                    for pid in r.pids():
                        for tid in os.listdir(f"/proc/{pid}/task"):  # the nice value is per thread
                            os.setpriority(os.PRIO_PROCESS, int(tid), args.router_nice)
            fresh = []
            log(f"group {gname}: servers up (logs in {log_dir})")
            groups.append(run_group(gname, group, single, {n: p for n, (p, _) in ps.items()},
                                    ds, routers, work, args))
            for srv in group_servers:
                srv.stop()
                servers.remove(srv)
    finally:
        for srv in list(servers):
            srv.stop()

    commit = source_commit()
    result = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "commit": commit, "command": " ".join(["bench_ttft_breakdown.py",
                                                              *sys.argv[1:]]),
                       "host": platform.node(), "cpus": os.cpu_count(),
                       "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                       "requests": args.requests, "extra_config": extra, "notes": args.notes,
                       "salt": args.salt, "gap_s": args.gap_s, "burst": args.burst,
                       "pin": args.pin,
                       "router_nice": args.router_nice,
                       "timing": args.timing,
                       "log_dir": str(log_dir)},
              "groups": groups}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    write_md(out.with_suffix(".md"), result)
    log(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
