"""The serving benchmark's logic without servers: statistics, the alternating order, pull's
saturation rule, the goal ratios, the load discipline (benchmarks/serving_*.py)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import serving_client as sc  # noqa: E402
import serving_load as sl  # noqa: E402
import serving_stats as ss  # noqa: E402


def req(ttft, e2e=None, arrival=0.0, error=None, lag=0.0):
    return {"ttft": ttft, "e2e": e2e if e2e is not None else (ttft or 0) + 0.1, "tpot": 0.01,
            "arrival": arrival, "send_lag": lag, "error": error}


# -- order ----------------------------------------------------------------------------------

def test_rounds_alternate_abcd_dcba():
    seq = ss.round_sequence(["a", "b", "c", "d"], 3)
    assert [s for s, _ in seq] == list("abcd") + list("dcba") + list("abcd")
    assert [p for _, p in seq] == [1] * 4 + [2] * 4 + [3] * 4
    assert ss.round_sequence(["a", "b"], 1) == [("a", 1), ("b", 1)]


# -- summaries --------------------------------------------------------------------------------

def test_summarize_percentiles_and_errors():
    reqs = [req(t / 10, arrival=t) for t in range(1, 11)] + [req(None, error="HTTP 500: x")]
    s = ss.summarize(reqs)
    assert (s["n"], s["ok"], s["errors"]) == (11, 10, 1)
    assert s["ttft"]["p50"] == pytest.approx(0.55)
    assert s["ttft"]["p90"] == pytest.approx(0.91)
    assert s["error_kinds"] == {"HTTP 500: x": 1}


def test_throughput_follows_offered_rate_with_constant_latency():
    # 1 req/s offered, every request takes 3 s: ends are spaced like the arrivals
    reqs = [req(0.2, e2e=3.0, arrival=float(i)) for i in range(10)]
    r = ss.rates(reqs)
    assert r["offered_rps"] == pytest.approx(1.0)
    assert r["completed_rps"] == pytest.approx(1.0)
    assert r["throughput_ratio"] == pytest.approx(1.0)


def test_throughput_of_a_saturated_server_falls_below_offered():
    # 10 req/s offered, a server that serves one per 0.5 s: ends every 0.5 s
    reqs = [req(0.1, e2e=0.5 * (i + 1) - 0.1 * i, arrival=0.1 * i) for i in range(10)]
    r = ss.rates(reqs)
    assert r["offered_rps"] == pytest.approx(10.0)
    assert r["completed_rps"] == pytest.approx(2.0)
    assert r["throughput_ratio"] == pytest.approx(0.2)


def test_failed_requests_lower_the_throughput_ratio():
    reqs = [req(0.1, e2e=1.0, arrival=float(i)) for i in range(8)]
    reqs += [req(None, arrival=8.0 + i, error="timeout") for i in range(2)]
    r = ss.rates(reqs)
    assert r["throughput_ratio"] < 0.9


# -- saturation -------------------------------------------------------------------------------

def summary_with(p50, ratio=1.0, n=10, errors=0):
    return {"n": n, "ok": n - errors, "errors": errors, "ttft": {"p50": p50},
            "throughput_ratio": ratio, "completed_rps": ratio * 4, "offered_rps": 4.0}


def test_saturation_by_ttft_blowup_throughput_or_failures():
    kw = dict(ttft_factor=5.0, min_throughput=0.8)
    assert ss.saturation(summary_with(0.4), 0.1, **kw) is None          # 4x: not yet
    assert "TTFT p50" in ss.saturation(summary_with(0.6), 0.1, **kw)    # 6x
    assert "completed" in ss.saturation(summary_with(0.2, ratio=0.5), 0.1, **kw)
    assert "failed" in ss.saturation(summary_with(0.2, errors=6), 0.1, **kw)
    assert ss.saturation(summary_with(0.2, errors=5), 0.1, **kw) is None
    assert ss.saturation(summary_with(9.0), None, **kw) is None  # no baseline: TTFT rule off


def test_rate_cap_is_pulls_lowest_saturation():
    assert ss.rate_cap([]) is None
    sats = [{"system": "pull", "rate": 16.0}, {"system": "pull", "rate": 8.0},
            {"system": "push", "rate": 1.0}]
    assert ss.rate_cap(sats) == 8.0
    # a discarded pass caps only while no kept one has saturated
    sats = [{"system": "pull", "rate": 2.0, "discarded": True}]
    assert ss.rate_cap(sats) == 2.0
    sats.append({"system": "pull", "rate": 8.0, "discarded": False})
    assert ss.rate_cap(sats) == 8.0


# -- pooling and goals ---------------------------------------------------------------------------

def run(system, point, ttfts, pas=1, discarded=False):
    return {"system": system, "point": point, "pass": pas, "discarded": discarded,
            "requests": [req(t, arrival=float(i)) for i, t in enumerate(ttfts)]}


POINTS = [{"sweep": "conc1", "rate": 0.0, "prompt_len": 512},
          {"sweep": "rate", "rate": 1.0, "prompt_len": 512},
          {"sweep": "rate", "rate": 8.0, "prompt_len": 512},
          {"sweep": "rate", "rate": 16.0, "prompt_len": 512}]
K = [ss.point_key(p) for p in POINTS]


def test_point_keys():
    assert K == ["conc1:len=512", "rate:rate=1:len=512", "rate:rate=8:len=512",
                 "rate:rate=16:len=512"]


def test_pooled_summary_skips_discarded_passes():
    runs = [run("push", K[1], [0.1] * 5, pas=1), run("push", K[1], [9.0] * 5, pas=2,
                                                     discarded=True),
            run("push", K[1], [0.3] * 5, pas=3)]
    s = ss.pooled_summary(ss.kept(runs), ["push"], K)
    assert s["push"][K[1]]["n"] == 10
    assert s["push"][K[1]]["passes"] == [1, 3]
    assert s["push"][K[1]]["ttft"]["p50"] == pytest.approx(0.2)
    assert ss.pooled_summary(runs, ["push"], K)["push"][K[1]]["n"] == 15


def test_pooled_rates_are_per_run_means_and_none_at_concurrency_1():
    # two passes at 1 req/s whose arrivals both start at 0: pooled naively they would look
    # like 2 req/s offered
    runs = [run("push", K[1], [0.1] * 5, pas=1), run("push", K[1], [0.1] * 5, pas=2),
            run("push", K[0], [0.1] * 5, pas=1)]
    s = ss.pooled_summary(runs, ["push"], K)["push"]
    assert s[K[1]]["offered_rps"] == pytest.approx(1.0)
    assert s[K[1]]["throughput_ratio"] == pytest.approx(1.0)
    assert s[K[0]]["throughput_ratio"] is None


def test_goals_at_highest_rate_with_both_push_and_pull():
    runs = []
    for key, push, pull, up in ((K[0], 0.05, 0.1, 0.08), (K[1], 0.1, 0.2, 0.1),
                                (K[2], 0.2, 1.0, 0.3)):
        runs += [run("push", key, [push] * 5), run("pull", key, [pull] * 5),
                 run("upstream-push", key, [up] * 5)]
    runs.append(run("push", K[3], [0.3] * 5))  # push only: not the highest common load
    s = ss.pooled_summary(runs, ["push", "pull", "upstream-push"], K)
    g = ss.goal_figures(s, POINTS)
    assert g["highest_load_point"] == K[2]
    h = g["high_load_p50"]
    assert h["push_over_pull"] == pytest.approx(0.2) and h["met_vs_pull"] is True
    assert h["push_over_upstream_push"] == pytest.approx(2 / 3) and h["met_vs_upstream_push"]
    lo = g["low_load_p50"]
    assert g["low_load_points"] == [K[0], K[1]]
    assert lo["never_worse_vs_pull"] is True
    assert lo["worst_ratio_vs_upstream_push"] == pytest.approx(1.0)
    assert lo["never_worse_vs_upstream_push"] is True  # equal is not worse
    r = ss.ratio_table(s, POINTS)
    assert r[K[2]]["push_over_pull_p50"] == pytest.approx(0.2)
    assert r[K[3]]["push_over_pull_p50"] is None


def test_goals_fail_when_push_is_slower():
    runs = [run("push", K[1], [0.5] * 5), run("pull", K[1], [0.4] * 5),
            run("push", K[0], [0.2] * 5), run("pull", K[0], [0.1] * 5)]
    g = ss.goal_figures(ss.pooled_summary(runs, ["push", "pull"], K), POINTS)
    assert g["high_load_p50"]["met_vs_pull"] is False
    assert g["high_load_p50"]["met_vs_upstream_push"] is None  # not measured
    assert g["low_load_p50"]["never_worse_vs_pull"] is False
    assert g["low_load_p50"]["worst_ratio_vs_pull"] == pytest.approx(2.0)
    assert g["low_load_p50"]["never_worse_vs_upstream_push"] is None


def test_concurrency_1_goal_against_the_single_server_per_system():
    # issue 12 item 4: push (first token from D) and push-first (from P) each against single
    runs = [run("push", K[0], [0.04] * 5), run("push-first", K[0], [0.025] * 5),
            run("single", K[0], [0.02] * 5), run("push", K[1], [0.1] * 5),
            run("single", K[1], [0.01] * 5)]  # a rate point: not part of this goal
    s = ss.pooled_summary(runs, ["push", "push-first", "single"], K)
    g = ss.goal_figures(s, POINTS)["conc1_vs_single_p50"]
    assert set(g) == {f"push at {K[0]}", f"push-first at {K[0]}"}
    assert g[f"push at {K[0]}"]["ratio"] == pytest.approx(2.0)
    assert g[f"push at {K[0]}"]["met"] is False
    assert g[f"push-first at {K[0]}"]["ratio"] == pytest.approx(1.25)
    assert g[f"push-first at {K[0]}"]["met"] is True
    r = ss.ratio_table(s, POINTS)
    assert r[K[0]]["push_first_over_single_p50"] == pytest.approx(1.25)
    assert r[K[0]]["push_over_single_p50"] == pytest.approx(2.0)
    assert "push_first_over_single_p50" not in r[K[1]]  # push-first did not run there
    # without a single server (or without our systems) there is nothing to judge
    s2 = ss.pooled_summary(runs[:2], ["push", "push-first"], K)
    assert ss.goal_figures(s2, POINTS)["conc1_vs_single_p50"] == {}


# -- load discipline ---------------------------------------------------------------------------

def test_parse_proc_stat_and_task_stat():
    text = "cpu  1 2 3\nprocs_running 5\nprocs_blocked 2\nctxt 9\n"
    assert sl.parse_proc_stat(text) == 7
    line = "1234 (vllm: engine) core) R 1 777 777 0 -1 4194560 " + "0 " * 40
    assert sl.parse_task_stat(line) == ("R", 777)


def test_ema_follows_the_kernels_damping():
    v = 0.0
    for _ in range(60):
        v = sl.ema(v, 3.0, 1.0)
    assert v == pytest.approx(3.0 * (1 - math.exp(-1.0)))
    assert sl.ema(2.0, 2.0, 5.0) == pytest.approx(2.0)


def test_pass_load_and_judgement_by_rule():
    samples = [{"t": float(t), "raw_1m": 3.0 + t, "foreign_1m": 0.5} for t in range(10)]
    assert sl.pass_load(samples, 2, 4, "raw") == pytest.approx(6.0)
    assert sl.pass_load(samples, 2, 4, "foreign") == pytest.approx(0.5)
    assert sl.pass_load(samples, 20, 30, "raw") == pytest.approx(12.0)  # nearest sample
    assert sl.pass_load([], 0, 1, "raw") is None
    with pytest.raises(ValueError):
        sl.pass_load(samples, 0, 1, "other")
    assert sl.judge(2.5, 2)[0] is True
    assert sl.judge(2.0, 2)[0] is False
    assert sl.judge(None, 2)[0] is False


def test_monitor_counts_only_foreign_tasks(tmp_path):
    """A fake /proc: 6 runnable or blocked tasks; ours are this process's one running thread
    and a server group's running and blocked ones (its sleeping one does not count): foreign 3."""
    proc = tmp_path
    (proc / "stat").write_text("procs_running 5\nprocs_blocked 1\n")
    me = os.getpid()

    def task(pid, tid, state, pgid, utime=100, stime=50):
        d = proc / str(pid) / "task" / str(tid)
        d.mkdir(parents=True, exist_ok=True)
        line = (f"{tid} (x y) {state} 1 {pgid} {pgid} 0 -1 0 0 0 0 0 {utime} {stime} "
                + "0 " * 30)
        (d / "stat").write_text(line)
        if tid == pid:
            (proc / str(pid) / "stat").write_text(line)
    task(me, me, "R", 1)
    task(500, 500, "R", 500)
    task(500, 501, "D", 500)
    task(500, 502, "S", 500)
    task(900, 900, "R", 900)  # foreign
    mon = sl.LoadMonitor(proc=str(proc))
    mon.add_group(500)
    mon._foreign = 0.0  # as if seeded with an idle machine
    s = mon.sample()
    assert s["tasks_runnable"] == 6
    assert s["own_runnable"] == 3
    assert s["foreign_1m"] == pytest.approx(sl.ema(0.0, 3, 1.0))
    # our CPU: 4 tasks x 150 ticks so far; the next sample sees 60 more ticks
    task(500, 500, "R", 500, utime=160)
    s2 = mon.sample()
    assert s2["own_cpu_cores"] is not None and s2["own_cpu_cores"] > 0
    w = mon.window(s["t"], s2["t"])
    assert w["samples"] == 2 and w["own_runnable_max"] == 3
    later = mon.window(s2["t"] + 0.1, s2["t"] + 0.2)  # no sample inside: the nearest
    assert later["samples"] == 0 and later["own_runnable_mean"] == 3


# -- client pieces -------------------------------------------------------------------------------

def test_prompts_exact_distinct_and_arrivals_poisson():
    ps = sc.make_prompts(50, 130, 10, 1)
    assert all(len(p) == 130 and min(p) >= 3 and max(p) < 10 for p in ps)
    assert len({tuple(p) for p in ps}) == 50
    assert sc.make_prompts(3, 8, 100, 7) == sc.make_prompts(3, 8, 100, 7)
    offs = sc.arrivals(2000, 4.0, 3)
    assert offs[0] == 0.0 and offs == sorted(offs)
    assert (len(offs) - 1) / offs[-1] == pytest.approx(4.0, rel=0.1)


def test_report_of_a_results_file(tmp_path):
    import bench_serving as bs
    runs = [dict(run("push", K[1], [0.1] * 4), router_mode="push"),
            dict(run("pull", K[1], [0.5] * 4), router_mode="pull")]
    s = ss.pooled_summary(runs, ["push", "pull"], K)
    data = {"points": [dict(p, key=ss.point_key(p)) for p in POINTS], "summary": s,
            "ratios": ss.ratio_table(s, POINTS), "goals": ss.goal_figures(s, POINTS),
            "stacks": [{"system": "push", "pass": 1, "load_rule": "foreign", "pass_load": 3.1,
                        "discarded": True, "load_verdict": "load 3.10 > 2 cores"}],
            "runs": runs}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    text = bs.markdown_report(str(path))
    assert "| rate:rate=1:len=512 | push | 4/4 | 100 |" in text
    assert "0.20" in text and "(discarded)" in text


def test_parse_args_defaults_and_quick():
    import bench_serving as bs
    a = bs.parse_args([])
    assert a.systems == ["pull", "push", "push-first", "upstream-push", "single"]
    assert a.pin == "server"
    assert a.rounds == 2 and a.budget_s == 1650 and a.load_rule == "foreign"  # 330 s a system
    assert bs.parse_args(["--systems", "push,single"]).budget_s == 660
    q = bs.parse_args(["--quick", "--load-rule", "raw"])
    assert q.rounds == 1 and q.rates == [2.0, 8.0] and q.load_rule == "raw"
    assert q.budget_s == 750
    pts = bs.points_of(a)
    assert pts[0]["sweep"] == "conc1" and [p["rate"] for p in pts[1:]] == sorted(a.rates)
    with pytest.raises(SystemExit):
        bs.parse_args(["--systems", "push,push"])


def test_requests_per_point_follow_the_rate():
    import bench_serving as bs
    a = bs.parse_args(["--point-s", "10", "--min-requests", "8", "--conc1-requests", "5"])
    assert bs.requests_of({"sweep": "rate", "rate": 0.5, "prompt_len": 1}, a) == 8
    assert bs.requests_of({"sweep": "rate", "rate": 3.0, "prompt_len": 1}, a) == 30
    assert bs.requests_of({"sweep": "conc1", "rate": 0.0, "prompt_len": 1}, a) == 5
