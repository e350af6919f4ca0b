#!/usr/bin/env python
"""The critical path after prefill, push vs pull, on real NIXL (two processes, UCX loopback).

For Qwen3-32B-shaped KV (64 layers, 8 KV heads, head size 128, bf16), as TP 1 and as one TP-8
rank (1 KV head), at 1k / 4k / 16k tokens and block sizes 16 / 128, with block ids fragmented as
a busy server's are, it measures in one run, interleaved (the order rotates every repetition):

* push  -- D registered earlier and P holds the registration; from P's ``prefill_done`` call to
           D's ``received`` outcome, through the real ``PushWorker`` path;
* push* -- the same with D's transfer thread polling instead of spinning while it only waits
           for WriteDone (patched in the child; common/decoder.py does this since 2d263a4);
* pull  -- what vLLM's NixlConnector does: P's block ids reach D by one localhost HTTP request,
           D builds one descriptor per (layer, K/V, block) on each side, posts a NIXL READ that
           carries a notification to P and polls it to completion, P polls for the notification
           every millisecond; from P's prefill-done to the later of "D has the data" and "P got
           the notification";
* bare WRITE -- the push plan's regions, request built in advance: post + poll to DONE;
* bare READ  -- pull's per-block READ, request built in advance: post + poll to DONE;

plus the engine-loop cost of a hand-off: ``PushWorker.prefill_done`` / ``expect`` on the calling
thread. Times are ``time.monotonic()`` stamps taken inside the child processes (one clock for all
processes on Linux), so no pipe overhead is in them. The first transfer of every method and case
is a warm-up whose bytes are verified on D; it is not counted.

    .venv/bin/python benchmarks/bench_transfer.py            # full run (several minutes)
    .venv/bin/python benchmarks/bench_transfer.py --quick    # sanity run (~1 minute)

Writes ``benchmarks/results/transfer.json`` and ``transfer.md`` (``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from kv_push.common.testing.bench_peer_server import SERVER
from kv_push.common.testing.block_ids import fragmented_blocks
from kv_push.common.testing.peer_process import PeerError, PeerSpec, start_pair

HERE = Path(__file__).resolve().parent
QWEN3_32B = dict(num_layers=64, head_size=128, dtype_bytes=2)
SHAPES = {"TP1": 8, "TP8-rank": 1}  # KV heads held by the rank
METHODS = ("push", "push_dpoll", "pull", "bare_write", "bare_read")
GIB = 1 << 30
PROC_OVERHEAD_GIB = 0.3  # python + numpy + NIXL + pattern table, per process


def per_token_bytes(heads: int) -> int:
    return QWEN3_32B["num_layers"] * 2 * heads * QWEN3_32B["head_size"] * QWEN3_32B["dtype_bytes"]


def pool_blocks(tokens: int, bs: int, slack: float) -> int:
    return int(math.ceil(-(-tokens // bs) * slack)) + 2


def pair_gib(tokens: int, bs: int, heads: int, slack: float) -> float:
    return (2 * pool_blocks(tokens, bs, slack) * bs * per_token_bytes(heads)) / GIB \
        + 2 * PROC_OVERHEAD_GIB


def log(msg: str) -> None:
    print(msg, flush=True)


def wait_counter(peer, name: str, target: float, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while peer.call("counters").get(name, 0) < target:
        if time.monotonic() > deadline:
            raise PeerError(f"counter {name} never reached {target}")
        time.sleep(0.001)


class Pair:
    """P and D children for one geometry, both agents connected."""

    def __init__(self, heads: int, bs: int, blocks: int, heartbeat_s: float):
        common = dict(placement="kv_split", num_kv_heads=heads, block_size=bs, num_blocks=blocks,
                      token_order="NHD", **QWEN3_32B)
        hb = {"heartbeat_interval_s": heartbeat_s}
        self.P, self.D = start_pair(
            PeerSpec(role="producer", engine_id="bench-prefill",
                     config={"side_channel_port": 0, **hb}, **common),
            PeerSpec(role="decoder", engine_id="bench-decode", config=hb, **common),
            server=SERVER)
        for peer in (self.P, self.D):
            peer.call("instrument")  # push-path events, summarised by take_events
        self.address = self.P.call("address")
        self.pgeo, self.dgeo = self.P.call("geometry"), self.D.call("geometry")
        self.P.call("pull_add_peer", self.D.call("pull_agent_metadata"), self.dgeo)
        self.D.call("pull_add_peer", self.P.call("pull_agent_metadata"), self.pgeo)
        self.port = self.D.call("http_port")
        self.early = 0
        self.seq = 0

    def close(self) -> None:
        self.P.close()
        self.D.close()

    # -- the four methods; each returns {"total": seconds, ...breakdown} ---------------------------
    def push(self, pblocks, dblocks, tokens) -> dict:
        self.seq += 1
        key, tid = f"push-{self.seq}", f"xfer-push-{self.seq}"
        self.D.call("expect_at", key, tid, 0, self.address, dblocks, 0, tokens)
        self.early += 1
        wait_counter(self.P, "registrations_early", self.early)
        self.P.call("take_events")
        self.D.call("take_events")
        t0 = self.P.call("prefill_done_at", key, tid, pblocks, tokens)
        got = self.D.call("outcome_at", key, 300.0)
        if got is None or got[0] != "received":
            raise PeerError(f"push {key}: {got}")
        t_out = got[2]
        if self.P.call("wait_released", [key], 30.0) != [key]:
            raise PeerError(f"push {key}: P never released its blocks")
        pe, de = self.P.call("take_events"), self.D.call("take_events")
        seg = {
            "queue": pe["thread_start"] - t0,
            "plan": pe["plan_end"] - pe["plan_start"],
            "desc_arrays": pe["descs_start"] - pe["plan_end"],
            "nixl_dlists": pe["descs_end"] - pe["descs_start"],
            "init_xfer": pe["init_end"] - pe["init_start"],
            "post": pe["post_end"] - pe["post_start"],
            "post_to_done": pe["done"] - pe["post_end"],
            "done_to_d_notice": de["writedone"] - pe["done"],
            "notice_to_outcome": t_out - de["writedone"],
        }
        return {"total": t_out - t0, "seg": seg, "regions": pe.get("regions"),
                "unmerged": pe.get("unmerged"), "polls": pe.get("polls"),
                "post_state": pe.get("post_state")}

    def push_dpoll(self, pblocks, dblocks, tokens) -> dict:
        """Push with the proposed decoder change: D's transfer thread does not spin while it
        only waits for ``WriteDone`` (polls every idle_poll_s); patched in the child."""
        self.D.call("decoder_spin", False)
        try:
            return self.push(pblocks, dblocks, tokens)
        finally:
            self.D.call("decoder_spin", True)

    def pull(self, pblocks, dblocks, tokens) -> dict:
        self.seq += 1
        key = f"pull-{self.seq}"
        self.D.call("pull_expect", key, dblocks)
        t0 = self.P.call("pull_prefill_done", key, pblocks, tokens, self.port)
        res = self.D.call("pull_result", key, 300.0)
        tn = self.P.call("pull_notif_at", key, 60.0)
        if res is None or res.get("state") != "DONE" or tn is None:
            raise PeerError(f"pull {key}: D {res}, P notified at {tn}")
        seg = {
            "relay_http": res["http"] - t0,
            "d_queue": res["start"] - res["http"],
            "desc_build": res["desc"] - res["start"],
            "post": res["post"] - res["desc"],
            "read_to_done": res["done"] - res["post"],
            "done_to_p_notif": tn - res["done"],
        }
        return {"total": max(res["done"], tn) - t0, "d_has_data": res["done"] - t0, "seg": seg,
                "descs": res["descs"]}

    def _bare(self, op: str, pblocks, dblocks, tokens) -> dict:
        init, target = (self.P, self.D) if op == "WRITE" else (self.D, self.P)
        target.call("progress", True)
        try:
            prep = init.call("bare_prepare", op, pblocks, dblocks, tokens)
            r = init.call("bare_run", op)
            init.call("bare_release", op)
        finally:
            target.call("progress", False)
        if r["state"] != "DONE":
            raise PeerError(f"bare {op}: {r}")
        return {"total": r["done"] - r["start"], "descs": prep["descs"],
                "seg": {"post": r["posted"] - r["start"], "post_to_done": r["done"] - r["posted"],
                        "prep_init_xfer": prep["init_s"], "prep_dlists": prep["dlist_s"]}}

    def bare_write(self, pblocks, dblocks, tokens) -> dict:
        return self._bare("WRITE", pblocks, dblocks, tokens)

    def bare_read(self, pblocks, dblocks, tokens) -> dict:
        return self._bare("READ", pblocks, dblocks, tokens)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(samples: list[dict], nbytes: int) -> dict:
    totals = [s["total"] for s in samples]
    m = med(totals)
    out = {"samples_ms": [round(t * 1e3, 3) for t in totals], "median_ms": m * 1e3,
           "min_ms": min(totals) * 1e3, "gbps": nbytes / m / 1e9}
    segs = [s["seg"] for s in samples if "seg" in s]
    if segs:
        out["breakdown_ms"] = {k: med([s[k] for s in segs]) * 1e3 for k in segs[0]}
    for extra in ("regions", "unmerged", "descs", "polls", "post_state"):
        if extra in samples[0]:
            out[extra] = samples[0][extra]
    if "d_has_data" in samples[0]:
        out["d_has_data_ms"] = med([s["d_has_data"] for s in samples]) * 1e3
    return out


def run_case(pair: Pair, rng, shape: str, heads: int, bs: int, tokens: int, blocks: int,
             args) -> dict:
    nbytes = tokens * per_token_bytes(heads)
    n = -(-tokens // bs)
    pblocks = fragmented_blocks(rng, blocks, n)
    dblocks = fragmented_blocks(rng, blocks, n)
    seed = int(rng.integers(1 << 20))
    pair.P.call("fill_pattern", seed, tokens, pblocks, timeout=600)
    verified = {}
    warm = 0.0
    for m in METHODS:  # warm-up, bytes checked
        pair.D.call("zero_blocks", dblocks, timeout=600)
        warm += getattr(pair, m)(pblocks, dblocks, tokens)["total"]
        bad = pair.D.call("verify_pattern", seed, tokens, dblocks, timeout=600)
        verified[m] = bad == 0
        if bad:
            log(f"    !! {m}: {bad} bytes wrong on D")
    # small cases are cheap and noisier: give them more repetitions
    reps = max(args.reps, min(args.max_reps, int(args.case_seconds / max(warm, 1e-3))))
    samples: dict[str, list] = {m: [] for m in METHODS}
    for r in range(reps):
        order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
        for m in order:
            samples[m].append(getattr(pair, m)(pblocks, dblocks, tokens))
    res = {m: summarize(samples[m], nbytes) for m in METHODS}
    push, pull, bw, pd = (res[m]["median_ms"] for m in ("push", "pull", "bare_write", "push_dpoll"))
    pmin, lmin, bmin, pdmin = (res[m]["min_ms"] for m in ("push", "pull", "bare_write",
                                                          "push_dpoll"))
    return {"shape": shape, "kv_heads": heads, "block_size": bs, "tokens": tokens,
            "bytes": nbytes, "blocks": n, "pool_blocks": blocks, "reps": reps,
            "verified": verified, **res,
            "push_over_bare": push / bw, "pull_over_push": pull / push,
            "push_over_bare_min": pmin / bmin, "pull_over_push_min": lmin / pmin,
            "push_dpoll_over_bare": pd / bw, "pull_over_push_dpoll": pull / pd,
            "push_dpoll_over_bare_min": pdmin / bmin, "pull_over_push_dpoll_min": lmin / pdmin,
            "loadavg": os.getloadavg()}


def handoff(args) -> dict:
    """Engine-side cost of a hand-off, on a small pair (the cost does not depend on the pool)."""
    spec = dict(placement="kv_split", num_layers=2, num_kv_heads=1, head_size=128,
                dtype_bytes=2, block_size=16, num_blocks=64, token_order="NHD",
                env={"KV_PUSH_LOG": "ERROR"})  # thousands of expired hand-offs: not news
    cfg = {"heartbeat_interval_s": 60.0, "rendezvous_ttl_s": 2.0, "transfer_timeout_s": 5.0}
    P, D = start_pair(PeerSpec(role="producer", config={"side_channel_port": 0, **cfg}, **spec),
                      PeerSpec(role="decoder", config=cfg, **spec), server=SERVER)
    try:
        address = P.call("address")
        out = {}
        for nb in (256, 1024):  # block ids of a 4k / 16k prompt at block size 16
            out[f"prefill_done_{nb}"] = P.call("handoff_cost", "prefill_done", args.handoff_calls,
                                               nb, timeout=600)
            out[f"expect_{nb}"] = D.call("handoff_cost", "expect", args.handoff_calls, nb,
                                         address, timeout=600)
        return out
    finally:
        D.close()  # D first: its thousands of pending registrations just go away with it
        P.close()


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--block-sizes", default="16,128")
    ap.add_argument("--shapes", default="TP1,TP8-rank", help=f"of {list(SHAPES)}")
    ap.add_argument("--reps", type=int, default=7,
                    help="measured repetitions per method (at least)")
    ap.add_argument("--max-reps", type=int, default=15,
                    help="small cases get more repetitions, up to this many")
    ap.add_argument("--case-seconds", type=float, default=8.0,
                    help="aim for about this much measured transfer time per case")
    ap.add_argument("--heartbeat-s", type=float, default=30.0,
                    help="PushConfig.heartbeat_interval_s on both sides (a peer silent for 1.5x "
                         "is declared dead). On CPU a WRITE is one synchronous call that blocks "
                         "the producer's heartbeats; on a loaded host a 4 GiB one can outlast the "
                         "default")
    ap.add_argument("--max-gib", type=float, default=10.0,
                    help="memory both processes may use together; cases that need more are "
                         "skipped")
    ap.add_argument("--slack", type=float, default=1.125,
                    help="pool size / blocks of the largest case of a geometry")
    ap.add_argument("--handoff-calls", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quick", action="store_true",
                    help="1k and 4k tokens, 3 reps, 2,000 hand-off calls")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--render", metavar="JSON",
                    help="only rewrite the markdown next to an existing results JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.reps, args.max_reps, args.handoff_calls = "1024,4096", 3, 5, 2000
    args.token_list = [int(t) for t in args.tokens.split(",")]
    args.bs_list = [int(b) for b in args.block_sizes.split(",")]
    args.shape_list = [s.strip() for s in args.shapes.split(",")]
    for s in args.shape_list:
        if s not in SHAPES:
            ap.error(f"unknown shape {s}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.render:
        src = Path(args.render)
        src.with_suffix(".md").write_text(markdown(json.loads(src.read_text())))
        return 0
    rng = np.random.default_rng(args.seed)
    t_start = time.monotonic()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    cases, skipped = [], []
    plan = []
    for shape in args.shape_list:
        heads = SHAPES[shape]
        for bs in args.bs_list:
            fit = [t for t in args.token_list if pair_gib(t, bs, heads, args.slack) <= args.max_gib]
            for t in args.token_list:
                if t not in fit:
                    skipped.append({"shape": shape, "block_size": bs, "tokens": t,
                                    "need_gib": round(pair_gib(t, bs, heads, args.slack), 2),
                                    "reason": f"needs {pair_gib(t, bs, heads, args.slack):.1f} GiB "
                                              f"> --max-gib {args.max_gib}"})
            if fit:
                plan.append((shape, heads, bs, fit))
    total = sum(len(f) for *_, f in plan)
    log(f"bench_transfer: {total} cases ({len(skipped)} skipped for memory), {args.reps} reps "
        f"each of {', '.join(METHODS)}; load average {os.getloadavg()[0]:.1f}")
    for s in skipped:
        log(f"  skip {s['shape']} bs{s['block_size']} {s['tokens']} tokens: {s['reason']}")
    done = 0
    failed = []
    for shape, heads, bs, fit in plan:
        blocks = pool_blocks(max(fit), bs, args.slack)
        gib = pair_gib(max(fit), bs, heads, args.slack)
        log(f"[{shape} bs{bs}] starting P and D, pools of {blocks} blocks (~{gib:.1f} GiB "
            f"together)...")
        t = time.monotonic()
        pair = Pair(heads, bs, blocks, args.heartbeat_s)
        log(f"  ready in {time.monotonic() - t:.1f}s")
        try:
            for tokens in fit:
                done += 1
                t = time.monotonic()
                log(f"  [{done}/{total}] {shape} bs{bs} {tokens} tokens "
                    f"({tokens * per_token_bytes(heads) / 2**20:.0f} MiB)...")
                try:
                    c = run_case(pair, rng, shape, heads, bs, tokens, blocks, args)
                except PeerError as e:
                    log(f"    FAILED: {str(e).strip().splitlines()[-1]}")
                    failed.append({"shape": shape, "block_size": bs, "tokens": tokens,
                                   "error": str(e)})
                    continue
                cases.append(c)
                log(f"    ms: push {c['push']['median_ms']:.1f} | push* "
                    f"{c['push_dpoll']['median_ms']:.1f} | pull {c['pull']['median_ms']:.1f}"
                    f" | bare WRITE {c['bare_write']['median_ms']:.1f} | bare READ "
                    f"{c['bare_read']['median_ms']:.1f} || push/bare "
                    f"{c['push_over_bare']:.2f} pull/push {c['pull_over_push']:.2f} | "
                    f"{c['reps']} reps, verified {all(c['verified'].values())} "
                    f"({time.monotonic() - t:.0f}s, load {os.getloadavg()[0]:.0f})")
        finally:
            pair.close()
    log(f"engine hand-off cost: {args.handoff_calls} calls each...")
    ho = handoff(args)
    for k, v in ho.items():
        log(f"  {k}: median {v['median_us']:.1f} us, p99 {v['p99_us']:.1f} us")
    result = {
        "started": started, "seconds": time.monotonic() - t_start, "loadavg_start": load_start,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "nixl": _nixl_version(),
                    "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
                    "loadavg_end": os.getloadavg()},
        "args": {k: v for k, v in vars(args).items() if not k.endswith("_list")},
        "model": "Qwen3-32B KV: 64 layers, 8 KV heads, head size 128, bf16",
        "cases": cases, "skipped": skipped, "failed": failed, "handoff": ho,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer.json").write_text(json.dumps(result, indent=1))
    (out / "transfer.md").write_text(markdown(result))
    log(f"\nwrote {out / 'transfer.json'} and {out / 'transfer.md'} "
        f"({time.monotonic() - t_start:.0f}s)\n")
    log(markdown(result))
    ok = not failed and all(all(c["verified"].values()) for c in cases)
    return 0 if ok else 1


def _nixl_version() -> str:
    try:
        from importlib.metadata import version
        return version("nixl")
    except Exception:  # noqa: BLE001
        return "?"


def _ms(x: dict) -> str:
    return f"{x['median_ms']:.1f} ({x['gbps']:.2f})"


def _ratio(c: dict, key: str) -> str:
    return f"{c[key]:.2f} [{c[key + '_min']:.2f}]"


def _case(c: dict) -> str:
    return f"{c['shape']} bs{c['block_size']} {c['tokens']}"


def markdown(r: dict) -> str:
    L = []
    m = r["machine"]
    a = r["args"]
    L.append("# Push vs pull: the critical path after prefill (real NIXL)\n")
    L.append(f"Command: `{r['command']}`  ")
    L.append(f"Started {r['started']}, {r['seconds']:.0f} s. Machine: {m['cpus']} CPUs (shared "
             f"with other work: load average {r.get('loadavg_start', [float('nan')])[0]:.1f} at "
             f"the start, {m['loadavg_end'][0]:.1f} at the end), {m['platform']}, Python "
             f"{m['python']}, nixl {m['nixl']}; UCX between two processes on one host (RMA: "
             f"cma zero-copy, notifications: tcp/lo), UCX_TLS {m['ucx_tls']}, host DRAM.  ")
    if r.get("note"):
        L.append(f"**Note:** {r['note']}  ")
    L.append(f"{r['model']}; TP8-rank = one rank of TP 8 (1 KV head; modelled as a 1-KV-head "
             f"geometry, byte-identical per rank). P and D: kv_split NHD, same block size; block "
             f"ids fragmented (runs of 1-3) independently on P and D. After one warm-up per "
             f"method whose bytes are verified on D, {a['reps']}-{a['max_reps']} interleaved "
             f"repetitions (order rotating). Times: median ms (GB/s). Ratios: median [best-of: "
             f"fastest repetition of each method, less sensitive to other load].\n")
    L.append("- **push**: the PushWorker path as it is (D registered earlier; P's prefill_done "
             "-> D's outcome `received`).")
    L.append("- **push\\***: the same with the decoder polling every idle_poll_s instead of "
             "spinning while it only waits for WriteDone, patched into the benchmark's child "
             "(common/decoder.py does this itself since commit 2d263a4: from then on push and "
             "push\\* run the same code).")
    L.append("- **pull**: vLLM NixlConnector-style: P's block ids -> D by one localhost HTTP "
             "request, D builds per-block descriptors, NIXL READ carrying a notification to P "
             "(P polls for it every 1 ms); until D has the data and P got the notification.")
    L.append("- **bare WRITE / READ**: request prepared in advance (push's regions / pull's "
             "per-block descriptors); post + poll to DONE only.\n")
    L.append("| case (tokens) | MiB | reps | push | push\\* | pull | bare WRITE | bare READ | "
             "push/bare | push\\*/bare | pull/push | pull/push\\* | regions push / pull |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in r["cases"]:
        L.append(f"| {_case(c)} | {c['bytes'] / 2**20:.0f} | {c['reps']} | {_ms(c['push'])} | "
                 f"{_ms(c['push_dpoll'])} | {_ms(c['pull'])} | {_ms(c['bare_write'])} | "
                 f"{_ms(c['bare_read'])} | {_ratio(c, 'push_over_bare')} | "
                 f"{_ratio(c, 'push_dpoll_over_bare')} | {_ratio(c, 'pull_over_push')} | "
                 f"{_ratio(c, 'pull_over_push_dpoll')} | {c['push'].get('regions')} / "
                 f"{c['pull'].get('descs')} |")
    for s in r["skipped"]:
        L.append(f"| {s['shape']} bs{s['block_size']} {s['tokens']} | skipped: {s['reason']} "
                 f"|||||||||||| ")
    for f in r["failed"]:
        L.append(f"| {f['shape']} bs{f['block_size']} {f['tokens']} | FAILED: "
                 f"{f['error'].strip().splitlines()[-1][:160]} |||||||||||| ")
    L.append("")
    L.append("Where push time goes (medians, ms; stamps inside the children): queue = "
             "prefill_done call to the transfer thread; plan = plan_writes; arrays = descriptor "
             "arrays + WriteDone encoding; dlists = NIXL get_xfer_descs x2; init = "
             "initialize_xfer; post = transfer() (on CPU the whole copy happens inside it); wait "
             "= post to the first DONE poll; notice = DONE to WriteDone handled on D (negative: "
             "D had it before P polled); outcome = to D's outcome.\n")
    keys = ["queue", "plan", "desc_arrays", "nixl_dlists", "init_xfer", "post", "post_to_done",
            "done_to_d_notice", "notice_to_outcome"]
    L.append("| case | queue | plan | arrays | dlists | init | post | wait | notice | outcome | "
             "total | push\\* post |")
    L.append("|---|" + "---:|" * (len(keys) + 2))
    for c in r["cases"]:
        b = c["push"]["breakdown_ms"]
        L.append(f"| {_case(c)} | " + " | ".join(f"{b[k]:.2f}" for k in keys)
                 + f" | {c['push']['median_ms']:.1f} | "
                 f"{c['push_dpoll']['breakdown_ms']['post']:.1f} |")
    L.append("")
    L.append("Where pull time goes (medians, ms): relay = P's prefill-done to D's HTTP handler; "
             "queue = to D's agent thread; descs = per-block descriptor arrays; post = "
             "get_xfer_descs + initialize_xfer + transfer() (the copy); read = to DONE on D; "
             "notif = D's DONE to P's notification (negative: P heard first).\n")
    pk = ["relay_http", "d_queue", "desc_build", "post", "read_to_done", "done_to_p_notif"]
    L.append("| case | relay | queue | descs | post | read | notif | D has data | total |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in r["cases"]:
        b = c["pull"]["breakdown_ms"]
        L.append(f"| {_case(c)} | " + " | ".join(f"{b[k]:.2f}" for k in pk)
                 + f" | {c['pull']['d_has_data_ms']:.1f} | {c['pull']['median_ms']:.1f} |")
    L.append("")
    L.append("Preparing the bare requests (outside their timed span; medians, ms):\n")
    L.append("| case | WRITE regions | WRITE dlists | WRITE init_xfer | READ descs | READ dlists | "
             "READ init_xfer |")
    L.append("|---|---:|---:|---:|---:|---:|---:|")
    for c in r["cases"]:
        w, rd = c["bare_write"]["breakdown_ms"], c["bare_read"]["breakdown_ms"]
        L.append(f"| {_case(c)} | {c['bare_write']['descs']} | {w['prep_dlists']:.2f} | "
                 f"{w['prep_init_xfer']:.2f} | {c['bare_read']['descs']} | "
                 f"{rd['prep_dlists']:.2f} | {rd['prep_init_xfer']:.2f} |")
    L.append("")
    ho = r["handoff"]
    if ho:
        first = next(iter(ho.values()))
        L.append(f"Engine-loop cost per hand-off: time on the calling (engine) thread, "
                 f"{first['batch']} calls per simulated engine step of "
                 f"{first['step_s'] * 1e3:.0f} ms, the transfer thread running alongside.\n")
        L.append("| call | block ids | calls | median µs | p99 µs | mean µs | max µs |")
        L.append("|---|---:|---:|---:|---:|---:|---:|")
        for k, v in ho.items():
            name = "PushWorker.prefill_done" if k.startswith("prefill") else "PushWorker.expect"
            L.append(f"| {name} | {v['block_ids']} | {v['calls']} | {v['median_us']:.1f} | "
                     f"{v['p99_us']:.1f} | {v['mean_us']:.1f} | {v['max_us']:.0f} |")
        L.append("")
    L.append("Targets (medians; best-of in brackets):")
    cs = r["cases"]
    if cs:
        for key, label in (("push_over_bare", "push"), ("push_dpoll_over_bare", "push*")):
            ok = sum(c[key] <= 1.15 for c in cs)
            okb = sum(c[key + "_min"] <= 1.15 for c in cs)
            worst = max(cs, key=lambda c: c[key])
            L.append(f"- {label} within 1.15x of bare WRITE: {ok}/{len(cs)} cases [{okb}/{len(cs)}]"
                     f"; worst {worst[key]:.2f}x ({_case(worst)}) -> "
                     f"{'met' if ok == len(cs) else 'NOT met'}.")
    sel = [c for c in cs if c["tokens"] == 16384 and c["block_size"] == 16]
    for c in sel:
        L.append(f"- pull/push >= 2x at 16k tokens, block size 16, {c['shape']}: "
                 f"{_ratio(c, 'pull_over_push')} (vs push*: {_ratio(c, 'pull_over_push_dpoll')})"
                 f" -> {'met' if c['pull_over_push'] >= 2 else 'NOT met'}.")
    if not sel:
        L.append("- pull/push at 16k tokens, block size 16: not measured in this run.")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
