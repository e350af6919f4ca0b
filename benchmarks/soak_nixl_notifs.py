#!/usr/bin/env python
"""Does NIXL's notification path alone grow native memory? (No kv_push protocol, no vLLM.)

Two spawned processes, each a ``NixlTransport`` (real NIXL, UCX over loopback) with 1 MiB of
DRAM registered, send each other notifications in one of four patterns and read their own
memory (resident set, glibc's heap in use, Python's allocated blocks) after every round:

* ``oneway-fixed``: A sends 300-byte notifications, B drains them;
* ``oneway-varied``: the same with sizes 80-379 bytes;
* ``pingpong-fixed``: A sends one (200 bytes) and waits for B's answer (120 bytes);
* ``pingpong-varied``: the same with sizes 80-379 and 60-259 bytes.

``soak_transfer_memory.py`` found a decoder's heap growing with cancelled transfers (a decoder
then sends a ``Cancel`` and is answered by notification) and flat on the plain path; this
separates what NIXL itself does with such traffic.

    .venv/bin/python benchmarks/soak_nixl_notifs.py          # 4 patterns x 8 rounds x 10,000

Writes ``benchmarks/results/soak_nixl_notifs.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proc_memory  # noqa: E402

PATTERNS = ("oneway-fixed", "oneway-varied", "pingpong-fixed", "pingpong-varied")
RESULTS = Path(__file__).resolve().parent / "results"


def _size(varied: bool, k: int, fixed: int, low: int, spread: int) -> int:
    return low + k % spread if varied else fixed


def _child(conn, name: str) -> None:
    import numpy as np

    from kv_push.common.transport import NixlTransport

    t = NixlTransport(name=name)
    buf = np.zeros(1 << 20, np.uint8)
    t.register([(buf.ctypes.data, buf.nbytes)], "DRAM", 0)
    conn.send(t.metadata())
    peer = t.add_peer(conn.recv())
    while True:
        cmd, n, varied = conn.recv()
        if cmd == "stop":
            break
        got = 0
        deadline = time.monotonic() + 120
        if cmd == "send":
            for k in range(n):
                t.send_notif(peer, b"x" * _size(varied, k, 300, 80, 300))
                t.get_notifs()
            got = n
        elif cmd == "drain":
            while got < n and time.monotonic() < deadline:
                got += len(t.get_notifs())
        elif cmd == "ping":  # got: pings answered (a missing answer ends the round)
            for k in range(n):
                t.send_notif(peer, b"p" * _size(varied, k, 200, 80, 300))
                while not t.get_notifs():
                    if time.monotonic() >= deadline:
                        break
                else:
                    got += 1
                    continue
                break
        elif cmd == "pong":
            while got < n and time.monotonic() < deadline:
                for _ in t.get_notifs():
                    got += 1
                    t.send_notif(peer, b"q" * _size(varied, got, 120, 60, 200))
        conn.send((got, proc_memory.reading()))
    t.close()


def run(pattern: str, rounds: int, per_round: int) -> dict:
    ctx = mp.get_context("spawn")
    ends, procs = {}, []
    for name in ("A", "B"):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(theirs, f"soak-{name}"), daemon=True)
        proc.start()
        ends[name], procs = mine, [*procs, proc]
    meta_a, meta_b = ends["A"].recv(), ends["B"].recv()
    ends["A"].send(meta_b)
    ends["B"].send(meta_a)
    a_cmd, b_cmd = ("ping", "pong") if pattern.startswith("pingpong") else ("send", "drain")
    varied = pattern.endswith("varied")
    samples = []
    for r in range(rounds):
        ends["B"].send((b_cmd, per_round, varied))
        ends["A"].send((a_cmd, per_round, varied))
        (sent, a_mem), (got, b_mem) = ends["A"].recv(), ends["B"].recv()
        # one way: A sent, B got; request/answer: A's answered pings, B's received ones
        samples.append({"round": r, "sent": per_round, "got": min(sent, got), "A": a_mem,
                        "B": b_mem})
    for end in ends.values():
        end.send(("stop", 0, False))
    for proc in procs:
        proc.join(10)
    # growth per message after the first round (its allocations are start-up's)
    span = per_round * (rounds - 1)
    growth = {side: {key: round((samples[-1][side][key] - samples[0][side][key]) / span, 2)
                     for key in ("rss", "heap_in_use", "py_blocks")} for side in ("A", "B")}
    lost = sum(s["sent"] - s["got"] for s in samples)
    return {"pattern": pattern, "messages_per_round": per_round, "lost": lost,
            "growth_per_message_bytes": growth, "samples": samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-round", type=int, default=10000)
    ap.add_argument("--out", type=Path, default=RESULTS / "soak_nixl_notifs.json")
    args = ap.parse_args(argv)
    started = datetime.now(timezone.utc).isoformat()
    results = []
    for pattern in args.patterns.split(","):
        if pattern not in PATTERNS:
            ap.error(f"--patterns: from {', '.join(PATTERNS)}, got {pattern!r}")
        results.append(run(pattern, args.rounds, args.per_round))
        g = results[-1]["growth_per_message_bytes"]
        print(f"{pattern:16s} heap in use per message: A {g['A']['heap_in_use']:+.2f} B, "
              f"B {g['B']['heap_in_use']:+.2f} B; lost {results[-1]['lost']}", flush=True)
    from importlib.metadata import version

    out = {"benchmark": "soak_nixl_notifs", "started": started,
           "nixl": version("nixl"), "config": {"rounds": args.rounds,
                                               "per_round": args.per_round},
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
