#!/usr/bin/env python
"""Does a decoder's or a producer's memory grow with the number of transfers, without vLLM?

Stop 31's soak of real vLLM P/D saw D's worker grow about 2 KB per transfer in memory Python
does not see (native), where kv_push's own Python objects on D stayed at ~5 KB. This runs the
same push path with no vLLM at all: one producer and one decoder ``PushWorker`` in two OS
processes (real NIXL, UCX over loopback), ``--transfers`` transfers one after the other (D
registers, P's prefill is handed over, D waits for its outcome, P's source is released), and
reads each process's memory every ``--every`` transfers: resident set (``VmRSS``), glibc's
heap (``mallinfo2``: bytes in use, arena), the number of Python objects alive
(``sys.getallocatedblocks``) and kv_push's own bookkeeping (``PushWorker.describe``). At the
end each process is asked to ``malloc_trim`` and read again: growth that a trim gives back is
the allocator's, not held memory.

    .venv/bin/python benchmarks/soak_transfer_memory.py                 # ~20,000 transfers
    .venv/bin/python benchmarks/soak_transfer_memory.py --transfers 2000 --every 200   # smoke

Writes ``benchmarks/results/soak_transfer_memory.json`` (``--out``): the samples and, per
process, the growth per transfer after the warm-up (a least-squares slope over the samples
after ``--warmup`` transfers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import proc_memory  # noqa: E402
from bench_meta import cpu_isa, source_commit  # noqa: E402

from kv_push.common.testing.peer_process import PeerSpec, start_pair  # noqa: E402
from kv_push.common.testing.peer_server import PeerServer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class MemoryPeer(PeerServer):
    """A ``PeerServer`` that also reports its process's memory."""

    def memory_reading(self) -> dict:
        described = self.worker.describe()
        return {**proc_memory.reading(),
                "kv_push": {k: v for k, v in described.items()
                            if isinstance(v, int) and not isinstance(v, bool)}}

    def trace_start(self) -> None:
        """Start tracing Python's allocations (container tables included) from here."""
        import tracemalloc

        tracemalloc.start(12)
        self._traced = tracemalloc.take_snapshot()

    def trace_growth(self, top: int = 12) -> list[str]:
        """Where memory traced since ``trace_start`` grew most (by traceback)."""
        import tracemalloc

        diff = tracemalloc.take_snapshot().compare_to(self._traced, "traceback")
        out = []
        for stat in diff[:top]:
            out.append(f"{stat.size_diff:+d} B in {stat.count_diff:+d} blocks:\n  "
                       + "\n  ".join(stat.traceback.format()[-8:]))
        return out

    def malloc_trim(self) -> None:
        proc_memory.malloc_trim()


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares growth of ``ys`` per unit of ``xs`` (0 with fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--transfers", type=int, default=20000)
    ap.add_argument("--every", type=int, default=1000, help="read memory every N transfers")
    ap.add_argument("--warmup", type=int, default=2000,
                    help="growth per transfer is fitted over the samples after this many")
    ap.add_argument("--trace", action="store_true",
                    help="trace Python's allocations in both processes from --warmup on and "
                         "print where they grew (slows the run)")
    ap.add_argument("--tokens", type=int, default=512, help="prompt length of each transfer")
    ap.add_argument("--cancel-every", type=int, default=0,
                    help="every Nth transfer D cancels its registration (a client hang-up), "
                         "alternately before and right after P's prefill is handed over (0: "
                         "none)")
    ap.add_argument("--out", type=Path, default=RESULTS / "soak_transfer_memory.json")
    args = ap.parse_args(argv)

    # the tiny e2e model's geometry on vLLM's CPU build: 2 layers, combined K|V, block 128
    common = dict(placement="combined", num_layers=2, num_kv_heads=2, head_size=64,
                  dtype_bytes=2, block_size=128, num_blocks=64, token_order="NHD")
    p_spec = PeerSpec(role="producer", engine_id="soak-p", **common)
    d_spec = PeerSpec(role="decoder", engine_id="soak-d", **common)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])
    P, D = start_pair(p_spec, d_spec, server="soak_transfer_memory:MemoryPeer")
    samples: list[dict] = []
    failed = 0  # transfers without their outcome, or whose source P kept
    outcomes: dict[str, int] = {}
    traced: dict[str, list[str]] = {}
    started_at = datetime.now(timezone.utc).isoformat()
    started = time.monotonic()
    try:
        addr = P.call("address")
        nblocks = -(-args.tokens // common["block_size"])
        rng = np.random.default_rng(0)
        for i in range(args.transfers + 1):
            if i % args.every == 0:
                samples.append({"transfers": i, "s": round(time.monotonic() - started, 1),
                                "P": P.call("memory_reading"), "D": D.call("memory_reading")})
                print(f"[{samples[-1]['s']:7.1f}s] {i:6d} transfers  "
                      f"P rss {samples[-1]['P']['rss'] / 2**20:7.1f} MiB heap "
                      f"{samples[-1]['P']['heap_in_use'] / 2**20:6.1f}  "
                      f"D rss {samples[-1]['D']['rss'] / 2**20:7.1f} MiB heap "
                      f"{samples[-1]['D']['heap_in_use'] / 2**20:6.1f}  failed {failed}",
                      flush=True)
            if args.trace and i == args.warmup:
                P.call("trace_start")
                D.call("trace_start")
            if i == args.transfers:
                break
            pblocks = [int(b) for b in rng.choice(common["num_blocks"], nblocks, replace=False)]
            dblocks = [int(b) for b in rng.choice(common["num_blocks"], nblocks, replace=False)]
            tid, pkey, dkey = f"soak-{i}", f"p-{i}", f"d-{i}"
            cancel = args.cancel_every and i % args.cancel_every == 0
            D.call("expect", dkey, tid, 0, addr, dblocks, 0, args.tokens)
            if cancel and (i // args.cancel_every) % 2:
                D.call("cancel", dkey, "soak hang-up")
            P.call("prefill_done", pkey, tid, pblocks, args.tokens)
            if cancel and not (i // args.cancel_every) % 2:
                D.call("cancel", dkey, "soak hang-up")
            outcome = D.call("wait_outcome", dkey, 15)
            kind = outcome[0] if outcome is not None else "none"
            outcomes[kind] = outcomes.get(kind, 0) + 1
            if kind != "received" and not (cancel and kind == "released"):
                failed += 1
            if P.call("wait_released", [pkey], 5) != [pkey]:
                failed += 1  # P kept the source
            P.call("drain_released")
        if args.trace:
            for side, peer in (("P", P), ("D", D)):
                traced[side] = peer.call("trace_growth")
                print(f"--- {side}: traced growth since transfer {args.warmup}")
                print("\n".join(traced[side]))
        for peer in (P, D):
            peer.call("malloc_trim")
        samples.append({"transfers": args.transfers, "s": round(time.monotonic() - started, 1),
                        "after_malloc_trim": True,
                        "P": P.call("memory_reading"), "D": D.call("memory_reading")})
    finally:
        P.close()
        D.close()

    fitted = [s for s in samples
              if s["transfers"] >= args.warmup and not s.get("after_malloc_trim")]
    growth = {}
    for side in ("P", "D"):
        xs = [s["transfers"] for s in fitted]
        growth[side] = {key: round(slope(xs, [s[side][key] for s in fitted]), 1)
                        for key in ("rss", "heap_in_use", "arena", "py_blocks")}
        late = fitted[len(fitted) // 2:]  # flat here where a record levels off (P's, at its TTL)
        growth[side]["rss_second_half"] = round(slope([s["transfers"] for s in late],
                                                      [s[side]["rss"] for s in late]), 1)
        growth[side]["rss_after_trim_minus_first_fitted"] = (
            samples[-1][side]["rss"] - fitted[0][side]["rss"]) if fitted else None
    out = {"benchmark": "soak_transfer_memory", "started": started_at,
           "commit": source_commit(), "cpu_isa": cpu_isa(), "config": {
               k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "geometry": common, "failed": failed, "outcomes": outcomes,
           "traced_python_growth": traced, "elapsed_s": round(time.monotonic() - started, 1),
           "growth_per_transfer_bytes": growth, "samples": samples}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"outcomes": outcomes, "growth_per_transfer_bytes": growth}, indent=1))
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
