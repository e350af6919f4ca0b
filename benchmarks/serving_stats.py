"""Statistics of the serving benchmark (``bench_serving.py``): per-request summaries, the
alternating pass order, pull's saturation rule, pooling over kept passes, and the goal ratios.

Pure functions on plain dicts (the JSON's records), so ``tests/test_bench_serving.py`` checks
them without servers.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

GOAL_VS_PULL = 0.6       # our TTFT at the highest load <= 0.6x pull's
GOAL_VS_UPSTREAM = 0.8   # ... and <= 0.8x upstream push's; never worse at low load
GOAL_VS_SINGLE = 1.3     # at concurrency 1: <= 1.3x a single server's TTFT (issue 12 item 4)
#: our P/D systems: the router's default (first token from D) and with the first token from P
#: (``--first-token-from-prefill auto``); ratios and the single-server goal are given for each
OURS = ("push", "push-first")
CONC1 = "conc1"          # the concurrency-1 (closed loop, one request at a time) point's sweep


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (numpy's linear interpolation); None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def point_key(p: dict) -> str:
    if p["sweep"] == CONC1:
        return f"{CONC1}:len={p['prompt_len']}"
    return f"{p['sweep']}:rate={p['rate']:g}:len={p['prompt_len']}"


def summarize(reqs: list[dict]) -> dict:
    """Counts, TTFT/TPOT/E2E p50/p90/p99/mean of the successful requests, error kinds and the
    offered vs completed rate (see ``rates``)."""
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
    out.update(rates(reqs))
    return out


def rates(reqs: list[dict]) -> dict:
    """``offered_rps``: the arrivals' own rate, (n - 1) / (last arrival - first arrival);
    ``completed_rps``: successful completions per second between the first and the last
    completion, (ok - 1) / (last end - first end), an end being arrival + send lag + E2E. A
    constant latency shifts every end alike and leaves the rate as offered; a server that cannot
    keep up spaces the ends by its service time, so the rate falls below the offered one.
    ``throughput_ratio`` = completed / offered (None with fewer than 3 requests or ends)."""
    arr = sorted(r["arrival"] for r in reqs if r.get("arrival") is not None)
    ends = sorted(r["arrival"] + (r.get("send_lag") or 0.0) + r["e2e"] for r in reqs
                  if r.get("error") is None and r.get("e2e") is not None
                  and r.get("arrival") is not None)
    offered = (len(arr) - 1) / (arr[-1] - arr[0]) if len(arr) >= 3 and arr[-1] > arr[0] else None
    done = (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) >= 3 and ends[-1] > ends[0] \
        else None
    if offered is None:
        tr = None
    elif done is None:
        tr = 0.0 if len(ends) < len(arr) else None
    else:  # failed requests complete nothing: scale by the share that succeeded
        tr = done / offered * len(ends) / len(arr)
    return {"offered_rps": offered, "completed_rps": done, "throughput_ratio": tr}


def round_sequence(systems: list[str], rounds: int) -> list[tuple[str, int]]:
    """(system, pass) in run order: round 1 in the given order (a b c d), round 2 reversed
    (d c b a), round 3 as round 1, ...; pass k is round k."""
    out = []
    for k in range(1, rounds + 1):
        order = systems if k % 2 == 1 else list(reversed(systems))
        out += [(s, k) for s in order]
    return out


def saturation(summary: dict, conc1_p50: float | None, *, ttft_factor: float,
               min_throughput: float) -> str | None:
    """Why a rate point of pull counts as saturated, or None: its TTFT p50 blew up (more than
    ``ttft_factor`` x its concurrency-1 TTFT p50; or no successful request), or its throughput
    stopped following the offered rate (completed / offered below ``min_throughput``; a point
    with more than half failed counts as saturated too)."""
    if summary["n"] == 0:
        return None
    if summary["ok"] == 0 or summary["errors"] > summary["n"] // 2:
        return f"{summary['errors']}/{summary['n']} requests failed"
    p50 = summary["ttft"]["p50"]
    if conc1_p50 is not None and p50 is not None and p50 > ttft_factor * conc1_p50:
        return (f"TTFT p50 {p50 * 1000:.0f} ms > {ttft_factor:g} x concurrency-1's "
                f"{conc1_p50 * 1000:.0f} ms")
    tr = summary.get("throughput_ratio")
    if tr is not None and tr < min_throughput:
        return (f"completed {summary['completed_rps']:.2f} req/s of {summary['offered_rps']:.2f} "
                f"offered ({tr:.2f} < {min_throughput:g})")
    return None


def kept(runs: Iterable[dict]) -> list[dict]:
    """The runs of passes not discarded by the load rule."""
    return [r for r in runs if not r.get("discarded")]


def pooled_summary(runs: list[dict], systems: list[str], keys: list[str]) -> dict:
    """{system: {point key: summarize(all requests of that system and point)}} over ``runs``."""
    out: dict[str, dict] = {}
    for system in systems:
        out[system] = {}
        for key in keys:
            reqs = [q for r in runs if r["system"] == system and r["point"] == key
                    for q in r["requests"]]
            if reqs:
                s = summarize(reqs)
                mine = [r for r in runs if r["system"] == system and r["point"] == key]
                s["passes"] = sorted({r["pass"] for r in mine})
                # rates only mean something per run (each run's arrivals start at 0), and not
                # at all in a closed loop: the mean of the runs' own, None at concurrency 1
                per_run = [rates(r["requests"]) for r in mine]
                for k in ("offered_rps", "completed_rps", "throughput_ratio"):
                    vals = [x[k] for x in per_run if x[k] is not None]
                    s[k] = (sum(vals) / len(vals) if vals and not key.startswith(CONC1)
                            else None)
                out[system][key] = s
    return out


def ttft_of(summary: dict, system: str, key: str, q: str) -> float | None:
    s = summary.get(system, {}).get(key)
    return s["ttft"][q] if s and s["ok"] else None


def ratio_table(summary: dict, points: list[dict]) -> dict:
    """{point key: {push_over_pull_p50, ..._p90, push_over_upstream_push_p50, ..._p90,
    push_over_single_p50, ..., and the same as push_first_over_... where ``push-first`` ran}}
    for every point with data of one of :data:`OURS`."""
    out = {}
    for p in points:
        key = point_key(p)
        row = {}
        for ours in OURS:
            if key not in summary.get(ours, {}):
                continue
            for base in ("pull", "upstream-push", "single"):
                for q in ("p50", "p90"):
                    row[ratio_key(ours, base, q)] = ratio(
                        ttft_of(summary, ours, key, q), ttft_of(summary, base, key, q))
        if row:
            out[key] = row
    return out


def ratio_key(ours: str, base: str, q: str) -> str:
    """``ratio_table``'s key of ``ours`` over ``base`` at ``q``: ``push_first_over_single_p50``."""
    return f"{ours}_over_{base}_{q}".replace("-", "_")


def goal_figures(summary: dict, points: list[dict]) -> dict:
    """The issue's goals: at the highest load -- the highest rate at which both push and pull
    have successful requests -- push's TTFT p50 and p90 <= 0.6x pull's and <= 0.8x upstream
    push's; at low load (the concurrency-1 point and the lowest rate) push never worse (ratio
    <= 1) than either; at concurrency 1, each of :data:`OURS` that ran <= 1.3x the single
    server (``conc1_vs_single_{q}``)."""
    rate_pts = sorted((p for p in points if p["sweep"] == "rate"), key=lambda p: p["rate"])
    both = [point_key(p) for p in rate_pts
            if ttft_of(summary, "push", point_key(p), "p50") is not None
            and ttft_of(summary, "pull", point_key(p), "p50") is not None]
    conc1_keys = [point_key(p) for p in points if p["sweep"] == CONC1]
    low_keys = list(conc1_keys)
    if rate_pts:
        low_keys.append(point_key(rate_pts[0]))
    high = both[-1] if both else None
    out: dict[str, Any] = {"highest_load_point": high, "low_load_points": low_keys,
                           "statistic": "TTFT p50 and p90"}
    for q in ("p50", "p90"):
        vp = ratio(ttft_of(summary, "push", high, q), ttft_of(summary, "pull", high, q)) \
            if high else None
        vu = ratio(ttft_of(summary, "push", high, q),
                   ttft_of(summary, "upstream-push", high, q)) if high else None
        out[f"high_load_{q}"] = {
            "push_over_pull": vp, "goal_vs_pull": GOAL_VS_PULL,
            "met_vs_pull": None if vp is None else vp <= GOAL_VS_PULL,
            "push_over_upstream_push": vu, "goal_vs_upstream_push": GOAL_VS_UPSTREAM,
            "met_vs_upstream_push": None if vu is None else vu <= GOAL_VS_UPSTREAM}
        low = {k: {"push_over_pull": ratio(ttft_of(summary, "push", k, q),
                                           ttft_of(summary, "pull", k, q)),
                   "push_over_upstream_push": ratio(ttft_of(summary, "push", k, q),
                                                    ttft_of(summary, "upstream-push", k, q))}
               for k in low_keys}
        entry: dict[str, Any] = {"ratios": low}
        for base in ("pull", "upstream_push"):
            vals = [d[f"push_over_{base}"] for d in low.values()]
            entry[f"never_worse_vs_{base}"] = (None if not vals or any(v is None for v in vals)
                                               else all(v <= 1.0 for v in vals))
            entry[f"worst_ratio_vs_{base}"] = max((v for v in vals if v is not None),
                                                  default=None)
        out[f"low_load_{q}"] = entry
        # issue 12 item 4: at concurrency 1, <= GOAL_VS_SINGLE x the single server, per system
        single = {}
        for ours in OURS:
            for k in conc1_keys:
                v = ratio(ttft_of(summary, ours, k, q), ttft_of(summary, "single", k, q))
                if v is not None:
                    single[f"{ours} at {k}"] = {"ratio": v, "goal": GOAL_VS_SINGLE,
                                                "met": v <= GOAL_VS_SINGLE}
        out[f"conc1_vs_single_{q}"] = single
    return out


def rate_cap(saturations: list[dict]) -> float | None:
    """The rate above which the other systems start no point: the lowest rate at which a kept
    pull pass saturated, or, while no kept pull pass has, a discarded one (so a loaded machine
    still bounds the run; a later kept pass then decides)."""
    pull = [s for s in saturations if s.get("system") == "pull"]
    good = [s["rate"] for s in pull if not s.get("discarded")]
    rs = good or [s["rate"] for s in pull]
    return min(rs) if rs else None


def fmt_ratio(v: float | None) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"
