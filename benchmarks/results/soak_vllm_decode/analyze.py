#!/usr/bin/env python3
"""Summarize /tmp/soakD/samples_<system>.jsonl: per process RSS at ~2 min and end, the
least-squares slope over t >= T0 (MB/min), and KB per completed request."""
import json
import sys
from pathlib import Path

T0 = float(sys.argv[1]) if len(sys.argv) > 1 else 120.0
KEYS = ("VmRSS", "sr_Private_Dirty", "sr_Anonymous")


def slope(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")


def role(p):
    if "api_server" in p.get("cmd", ""):
        return "api"
    if "router" in p.get("cmd", ""):
        return "router"
    if "resource_tracker" in p.get("cmd", ""):
        return "restrack"
    return p.get("comm", "?").replace("VLLM::", "")


for system in sys.argv[2:] or ("push", "pull"):
    path = Path(f"/tmp/soakD/samples_{system}.jsonl")
    if not path.exists():
        continue
    recs = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    recs = [r for r in recs if not r.get("final")]  # sampling during load only
    steady = [r for r in recs if r["t"] >= T0]
    if len(steady) < 3:
        print(system, "too few samples")
        continue
    first, last = steady[0], steady[-1]
    dt_min = (last["t"] - first["t"]) / 60
    nreq = last["done"] + last["errors"] - first["done"] - first["errors"]
    rate = nreq / dt_min
    print(f"== {system}: steady {first['t']:.0f}-{last['t']:.0f}s ({dt_min:.1f} min), "
          f"{nreq} requests in steady part ({rate:.0f}/min); total done {recs[-1]['done']} "
          f"err {recs[-1]['errors']} hangups {recs[-1]['hangups']}")
    for server in ("decode", "prefill", "router"):
        for p0 in first["procs"][server]:
            pid = p0["pid"]
            series = [(r["t"], next((p for p in r["procs"][server] if p["pid"] == pid), None))
                      for r in steady]
            series = [(t, p) for t, p in series if p and "VmRSS" in p]
            if role(p0) == "restrack":
                continue
            line = f"  {server:7s} {role(p0):10s} pid {pid}:"
            for k in KEYS:
                xs = [t / 60 for t, p in series]
                ys = [p.get(k, 0) / 1024 for t, p in series]
                s = slope(xs, ys)
                line += (f" | {k.replace('sr_', '')}: {ys[0]:.1f}->{ys[-1]:.1f} MB, "
                         f"{s:+.3f} MB/min, {s * 1024 / rate:+.3f} KB/req")
            print(line)
