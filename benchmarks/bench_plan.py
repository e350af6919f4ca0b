#!/usr/bin/env python3
"""What planning one transfer costs P's transfer thread (``layout.plan_writes``).

P plans each transfer on its transfer thread, right after the prefill's step, on the core the
engine's step is finishing on: every microsecond there is taken from the token's way out on a
small host, and the GIL's holder is the planner. Measured per call, wall time, two ways: back
to back (``hot``) and each after a 10 ms sleep (``cold``: caches and the core as a transfer
thread finds them when a prefill wakes it). Geometries: the suite's tiny model (2 layers, 2 KV
heads of 64, block 128: 512 tokens = 4 blocks) and a Llama-3-8B-like rank (32 layers, 8 KV
heads of 128, block 16: 512 tokens = 32 blocks), both sides alike (same layout, one TP),
block ids fragmented on D.

``--baseline CHECKOUT`` measures that checkout's planner too, in alternating child processes
(each checkout's ``kv_push`` through a shim folder first on ``sys.path``).

Usage::

    .venv/bin/python benchmarks/bench_plan.py --out benchmarks/results/plan.json
    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/bench_plan.py --baseline /tmp/base --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = {"tiny-512": dict(layers=2, heads=2, head_size=64, block=128, tokens=512),
         "8b-rank-512": dict(layers=32, heads=8, head_size=128, block=16, tokens=512)}


def _child(reps: int) -> dict:
    """In a child: time ``plan_writes`` for every case, hot and cold."""
    from kv_push.common import geometry as G
    from kv_push.common.layout import plan_writes

    out = {}
    for name, c in CASES.items():
        blocks = -(-c["tokens"] // c["block"])
        shape = dict(num_layers=c["layers"], num_kv_heads=c["heads"], head_size=c["head_size"],
                     dtype_bytes=2, dtype="bfloat16", block_size=c["block"],
                     num_blocks=4 * blocks)
        src = G.pooled(base=1 << 32, placement="kv_split", tp_size=1, tp_rank=0, **shape)
        dst = G.pooled(base=1 << 40, placement="kv_split", tp_size=1, tp_rank=0, **shape)
        s_ids = list(range(blocks))
        d_ids = [4 * blocks - 1 - 2 * i for i in range(blocks)]  # fragmented, descending
        regions = plan_writes(src, s_ids, dst, d_ids, first_token=0,
                              num_tokens=c["tokens"]).num_regions
        res = {"regions": regions}
        for how, gap in (("hot", 0.0), ("cold", 0.01)):
            ts = []
            for _ in range(reps):
                if gap:
                    time.sleep(gap)
                t = time.perf_counter()
                plan_writes(src, s_ids, dst, d_ids, first_token=0, num_tokens=c["tokens"])
                ts.append((time.perf_counter() - t) * 1e6)
            res[how] = ts
        out[name] = res
    return out


def _run(source: str | None, reps: int) -> dict:
    from bench_meta import checkout_env

    out = subprocess.run([sys.executable, __file__, "--child", str(reps)],
                         env=checkout_env(source), cwd="/",
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=300, help="calls per case and way, per round")
    ap.add_argument("--rounds", type=int, default=3, help="child processes per checkout")
    ap.add_argument("--baseline", default=None, metavar="CHECKOUT")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "plan.json"))
    args = ap.parse_args()
    from bench_meta import source_commit  # (the children run with PYTHONSAFEPATH: not there)

    systems = {"this": None, **({"baseline": args.baseline} if args.baseline else {})}
    raw: dict = {k: {} for k in systems}
    load0 = os.getloadavg()
    for _ in range(args.rounds):  # alternating
        for k, src in systems.items():
            for case, res in _run(src, args.reps).items():
                r = raw[k].setdefault(case, {"regions": res["regions"], "hot": [], "cold": []})
                r["hot"] += res["hot"]
                r["cold"] += res["cold"]
    summary = {k: {case: {"regions": r["regions"],
                          **{f"{how}_p50_us": statistics.median(r[how]) for how in ("hot", "cold")}}
                   for case, r in v.items()} for k, v in raw.items()}
    result = {"summary": summary,
              "meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "commit": source_commit(), "baseline": args.baseline,
                       "host": platform.node(), "cpus": os.cpu_count(), "reps": args.reps,
                       "rounds": args.rounds, "loadavg_before": load0,
                       "loadavg_after": os.getloadavg()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for k, v in summary.items():
        for case, s in v.items():
            print(f"{k:9s} {case:12s} {s['regions']:5d} regions: hot {s['hot_p50_us']:.0f} us, "
                  f"cold {s['cold_p50_us']:.0f} us (p50)")
    print(f"wrote {out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_child(int(sys.argv[2]))))
    else:
        main()
