#!/usr/bin/env python3
"""What an idle server costs in CPU: a plain vLLM server against our P and D (issue 12 item 4).

Real ``vllm serve`` (CPU build, the suite's tiny model), started as the end-to-end tests start
them (``kv_push.common.testing.vllm_servers``): one single server, one P/D pair with the
defaults and one P/D pair whose transfer threads never back off (``quiet_poll_s`` = 1 ms, which
is ``idle_poll_s``: how every worker polled NIXL before 2026-12-04 21:00), each pair behind a
router. Every system serves a few requests first (warm-up: handshakes, the first transfers),
then nothing is sent for ``--settle-s`` (longer than ``quiet_after_s``) and each server's
process group's CPU time (user + system, ``Server.cpu_seconds``) is read over ``--window-s``:
the share of one core it took while idle. Repeated ``--rounds`` times. Then, with the servers
stopped, what one wake-up of an idle transfer thread costs (``wake_costs``).

Usage::

    .venv/bin/python benchmarks/bench_idle_cpu.py            # ~3 min here
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench_meta import add_python_arg, source_commit
from kv_push.common.testing.vllm_servers import (Server, build_tiny_model, free_port, router,
                                                 vllm_server)

REPO = Path(__file__).resolve().parents[1]

#: the P/D pairs: name -> their kv_connector_extra_config additions
PAIRS = {"default": {}, "no back-off": {"quiet_poll_s": 0.001}}


def wake_costs() -> dict[str, dict[str, float]]:
    """CPU (user + system) and wall time per call, in µs, of what an idle transfer thread does
    once per wake-up: a timed wait on its wake event (as the loop waits: ``idle_poll_s``,
    ``await_poll_s``, ``quiet_poll_s``), a plain ``time.sleep`` for comparison, and the NIXL
    poll itself (an agent with no peers, UCX)."""
    from kv_push.common.transport import NixlTransport  # noqa: PLC0415 (after argument parsing)

    def per_call(fn, n: int) -> dict[str, float]:
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            fn()
        return {"cpu_us": (time.process_time() - c0) / n * 1e6,
                "wall_us": (time.perf_counter() - w0) / n * 1e6}

    event = threading.Event()
    transport = NixlTransport()
    try:
        return {"Event.wait(1 ms)": per_call(lambda: event.wait(0.001), 2000),
                "Event.wait(0.2 ms)": per_call(lambda: event.wait(0.0002), 5000),
                "Event.wait(20 ms)": per_call(lambda: event.wait(0.02), 100),
                "time.sleep(1 ms)": per_call(lambda: time.sleep(0.001), 2000),
                "nixl get_new_notifs": per_call(transport.get_notifs, 20000)}
    finally:
        transport.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle-s", type=float, default=5.0)
    ap.add_argument("--window-s", type=float, default=20.0)
    add_python_arg(ap)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "idle_cpu.json"))
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="idle-cpu-"))
    model = str(build_tiny_model(log_dir / "tiny"))
    servers: list[Server] = []
    urls: dict[str, str] = {}
    try:
        port = free_port()
        servers.append(vllm_server("single", python=args.python, model=model, port=port, cpu=0,
                                   log_dir=log_dir))
        urls["single"] = f"http://127.0.0.1:{port}"
        pairs = []
        for name, cfg in PAIRS.items():
            tag = name.replace(" ", "-")
            pp, dp, pk, dk = free_port(), free_port(), free_port(), free_port()
            p = vllm_server(f"p-{tag}", python=args.python, model=model, port=pp, cpu=0,
                            log_dir=log_dir, kv_role="kv_producer", kv_port=pk,
                            extra_config=cfg)
            d = vllm_server(f"d-{tag}", python=args.python, model=model, port=dp, cpu=1,
                            log_dir=log_dir, kv_role="kv_consumer", kv_port=dk,
                            extra_config=cfg)
            servers += [p, d]
            pairs.append((name, pp, pk, dp, p, d))
        for s in servers:
            s.wait_healthy()
        roles: dict[str, Server] = {"single": servers[0]}
        for name, pp, pk, dp, p, d in pairs:
            rp = free_port()
            r = router(python=args.python, port=rp, prefill=[(f"http://127.0.0.1:{pp}", pk)],
                       decode=[f"http://127.0.0.1:{dp}"], log_dir=log_dir, name=f"router-{name}")
            servers.append(r)
            r.wait_healthy()
            urls[name] = f"http://127.0.0.1:{rp}"
            roles.update({f"P ({name})": p, f"D ({name})": d, f"router ({name})": r})
        with httpx.Client(timeout=120, trust_env=False) as client:
            for url in urls.values():
                for i in range(3):
                    client.post(url + "/v1/completions", json={
                        "model": "tiny", "prompt": f"warm up {i} " * 20, "max_tokens": 4,
                        "temperature": 0}).raise_for_status()
        rounds = []
        for _ in range(args.rounds):
            time.sleep(args.settle_s)
            before = {k: s.cpu_seconds() for k, s in roles.items()}
            t0 = time.monotonic()
            time.sleep(args.window_s)
            elapsed = time.monotonic() - t0
            after = {k: s.cpu_seconds() for k, s in roles.items()}
            rounds.append({k: 100 * (after[k] - before[k]) / elapsed for k in roles})
            print(json.dumps({k: round(v, 1) for k, v in rounds[-1].items()}), flush=True)
    finally:
        for s in reversed(servers):
            s.stop()
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    wakes = wake_costs()  # with the servers gone: nothing else running
    result = {"meta": {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                             time.gmtime()),
                       "commit": source_commit(),
                       "cpus": os.cpu_count(), "machine": platform.platform(),
                       "settle_s": args.settle_s, "window_s": args.window_s,
                       "pairs": PAIRS, "unit": "percent of one core, idle"},
              "rounds": rounds, "median": median, "wake_cost_us": wakes}
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1))
    print(f"median (% of one core, idle): {json.dumps({k: round(v, 1) for k, v in median.items()})}"
          f"\nper wake-up (µs): {json.dumps({k: {m: round(v, 1) for m, v in c.items()} for k, c in wakes.items()})}"
          f"\nwrote {out}")


if __name__ == "__main__":
    main()
