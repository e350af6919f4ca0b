#!/usr/bin/env python
"""Pack and unpack speed of the staged path's torch ops (``common/staging_ops.py``), one process.

Qwen3-32B-shaped KV (64 layers, 8 KV heads, head size 128, 2-byte elements), one tensor per
layer shaped as vLLM allocates it: P ``(2, num_blocks, block_size, heads, 128)`` (NHD), D the same
or ``(2, num_blocks, heads, block_size, 128)`` (HND). Block ids are fragmented on both sides
(``fragmented_blocks`` over a pool 1.25x the request). Per case: P packs all layers into a staging
buffer (``pack``), the bytes are copied into D's slot (standing in for the WRITE; its time is the
same-run *copy rate*), D unpacks them (``unpack``). After the first repetition D's cache is
compared with P's on the device: every target token equal, every other byte of D still the canary
(``verified``). Times are medians over ``--reps`` (CUDA events on CUDA, wall clock on CPU); plan
building (numpy, on the host) is timed separately.

    python benchmarks/bench_staging_ops.py --quick --out /tmp/staging_ops.json     # CPU, seconds
    python benchmarks/bench_staging_ops.py --device cuda --out benchmarks/results/staging_ops.json

Needs torch, numpy and msgspec only; run from a checkout with the repo on ``PYTHONPATH`` (or the
``docs/gpu.md`` shim). ``--tp 8`` adds the TP8 slice (one head per rank on both sides).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def _import_core() -> None:
    """Import kv_push.common from a shim (kvtest, docs/gpu.md) or else from this checkout."""
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))  # last: kv_push/__init__.py when nothing else provides it
    import kv_push

    if "kv_push.common" not in sys.modules and str(REPO) not in kv_push.__path__:
        kv_push.__path__.append(str(REPO))  # the checkout's common/ becomes kv_push.common
    try:
        import kv_push.common.staging_ops  # noqa: F401
    except ModuleNotFoundError as e:
        raise SystemExit(f"cannot import this checkout's kv_push.common: {e}") from None


_import_core()
import torch  # noqa: E402

from kv_push.common import geometry as G  # noqa: E402
from kv_push.common.staging import pack_plan, slot_layout, unpack_plans  # noqa: E402
from kv_push.common.staging_ops import CacheViews, DevicePlan, pack, unpack  # noqa: E402
from kv_push.common.testing.block_ids import fragmented_blocks  # noqa: E402

QWEN3_32B = dict(num_layers=64, num_kv_heads=8, head_size=128, dtype_bytes=2)
CANARY = 0x5A5A


class Side:
    """One rank's KV cache: a tensor per layer, and its geometry."""

    def __init__(self, *, order: str, block_size: int, num_blocks: int, tp: int, device: str,
                 fill: int | None, gen: torch.Generator | None):
        q = QWEN3_32B
        heads = max(1, q["num_kv_heads"] // tp)
        shape = ((2, num_blocks, block_size, heads, q["head_size"]) if order == "NHD"
                 else (2, num_blocks, heads, block_size, q["head_size"]))
        self.order, self.block_size, self.heads = order, block_size, heads
        self.layers = []
        for _ in range(q["num_layers"]):
            if fill is None:
                t = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, device=device,
                                  generator=gen)
            else:
                t = torch.full(shape, fill, dtype=torch.int16, device=device)
            self.layers.append(t)
        dev = torch.device(device)
        self.geometry = G.kv_split(
            layer_bases=[(t.data_ptr(), t[1].data_ptr()) for t in self.layers],
            num_kv_heads=q["num_kv_heads"], head_size=q["head_size"],
            dtype_bytes=q["dtype_bytes"], dtype="bfloat16", block_size=block_size,
            num_blocks=num_blocks, tp_size=tp, tp_rank=0, token_order=order,
            mem_type="VRAM" if dev.type == "cuda" else "DRAM",
            dev_id=(dev.index or 0) if dev.type == "cuda" else 0)
        self.geometry.validate()

    def tokens(self, layer: int, blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """(2, num_tokens, heads, head_size) of ``layer`` read through ``blocks``."""
        t = self.layers[layer][:, blocks]
        if self.order == "HND":
            t = t.transpose(2, 3)
        return t.reshape(2, -1, self.heads, t.shape[-1])[:, :num_tokens]

    def fill(self, value: int) -> None:
        for t in self.layers:
            t.fill_(value)


def verify(p: Side, d: Side, sblk: list[int], dblk: list[int], num_tokens: int) -> bool:
    dev = p.layers[0].device
    s = torch.as_tensor(sblk, device=dev)
    db = torch.as_tensor(dblk, device=dev)
    unused = torch.ones(d.layers[0].shape[1], dtype=torch.bool, device=dev)
    unused[db] = False
    ok = True
    for l in range(len(p.layers)):
        ok &= bool(torch.equal(p.tokens(l, s, num_tokens), d.tokens(l, db, num_tokens)))
        ok &= bool((d.layers[l][:, unused] == CANARY).all())
        tail = d.tokens(l, db, len(dblk) * d.block_size)[:, num_tokens:]
        ok &= bool((tail == CANARY).all())
    return ok


def timer(cuda: bool):
    def run(fn) -> float:
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return run


def run_case(*, tokens: int, block_size: int, d_order: str, tp: int, device: str, reps: int,
             seed: int) -> dict:
    cuda = device.startswith("cuda")
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    nblk = -(-tokens // block_size)
    pool = max(nblk + 1, math.ceil(nblk * 1.25))
    p = Side(order="NHD", block_size=block_size, num_blocks=pool, tp=tp, device=device,
             fill=None, gen=gen)
    d = Side(order=d_order, block_size=block_size, num_blocks=pool, tp=tp, device=device,
             fill=CANARY, gen=None)
    sblk = fragmented_blocks(rng, pool, nblk)
    dblk = fragmented_blocks(rng, pool, nblk)

    t0 = time.perf_counter()
    gplan = pack_plan(p.geometry, sblk, d.geometry, first_token=0, num_tokens=tokens)
    (splan,) = unpack_plans(p.geometry, d.geometry, dblk, first_token=0,
                            num_tokens=tokens).values()
    plan_ms = (time.perf_counter() - t0) * 1e3
    slot = slot_layout(d.geometry, tp, first_token=0, num_tokens=tokens)
    nbytes = slot.total_bytes
    assert gplan.total_bytes == splan.total_bytes == nbytes
    pstage = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dslot = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pviews, dviews = CacheViews(p.geometry, device=device), CacheViews(d.geometry, device=device)
    gdev, sdev = DevicePlan(gplan, device), DevicePlan(splan, device)
    run = timer(cuda)

    times: dict[str, list[float]] = {"pack": [], "copy": [], "unpack": []}
    verified = None
    for rep in range(reps):
        times["pack"].append(run(lambda: pack(pviews, gdev, pstage).synchronize()))
        times["copy"].append(run(lambda: dslot.copy_(pstage)))
        times["unpack"].append(run(lambda: unpack(dviews, sdev, dslot).synchronize()))
        if rep == 0:
            verified = verify(p, d, sblk, dblk, tokens)
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: nbytes / (v * 1e-3) / 1e9 for k, v in med.items()}
    launches = lambda plan: plan.num_layers * plan.kv_parts * len(plan.segments)  # noqa: E731
    out = dict(
        tokens=tokens, block_size=block_size, tp=tp, p_order="NHD", d_order=d_order,
        bytes=nbytes, gather_unit=gplan.unit, scatter_unit=splan.unit,
        gather_rows=gplan.num_rows, scatter_rows=splan.num_rows,
        pack_launches=launches(gplan), unpack_launches=launches(splan),
        plan_ms=round(plan_ms, 3),
        **{f"{k}_ms_median": round(v, 3) for k, v in med.items()},
        **{f"{k}_ms_min": round(min(v), 3) for k, v in times.items()},
        **{f"{k}_GBps": round(v, 1) for k, v in gbps.items()},
        verified=verified,
    )
    del p, d, pstage, dslot, pviews, dviews
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--quick", action="store_true", help="small token count, 2 reps (CPU smoke)")
    ap.add_argument("--tokens", default=None,
                    help="comma list (default: 16384 on CUDA, 1024 on CPU, 256 with --quick)")
    ap.add_argument("--block-sizes", default="16,128")
    ap.add_argument("--d-orders", default="NHD,HND")
    ap.add_argument("--tp", default="1", help="comma list of TP sizes (both sides), e.g. 1,8")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here", file=sys.stderr)
        return 2
    cuda = args.device.startswith("cuda")
    tokens = args.tokens or ("16384" if cuda and not args.quick else
                             "256" if args.quick else "1024")
    reps = args.reps or (2 if args.quick else 5)
    cases = []
    print(f"{'tokens':>6} {'bs':>4} {'tp':>2} {'D':>3} {'MiB':>6} {'units':>13} "
          f"{'plan ms':>8} {'pack ms':>8} {'GB/s':>7} {'unpack ms':>9} {'GB/s':>7} "
          f"{'copy GB/s':>9} ok")
    for tp in (int(x) for x in args.tp.split(",")):
        for t in (int(x) for x in tokens.split(",")):
            for bs in (int(x) for x in args.block_sizes.split(",")):
                for order in args.d_orders.split(","):
                    c = run_case(tokens=t, block_size=bs, d_order=order, tp=tp,
                                 device=args.device, reps=reps, seed=args.seed)
                    cases.append(c)
                    print(f"{t:>6} {bs:>4} {tp:>2} {order:>3} {c['bytes'] / 2**20:>6.0f} "
                          f"{c['gather_unit'] + '/' + c['scatter_unit']:>13} "
                          f"{c['plan_ms']:>8.2f} {c['pack_ms_median']:>8.2f} "
                          f"{c['pack_GBps']:>7.1f} {c['unpack_ms_median']:>9.2f} "
                          f"{c['unpack_GBps']:>7.1f} {c['copy_GBps']:>9.1f} "
                          f"{c['verified']}", flush=True)
    result = dict(
        benchmark="bench_staging_ops",
        when=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        torch=torch.__version__, python=platform.python_version(),
        model="Qwen3-32B KV (64 layers, 8 KV heads, head 128, 2 B)", reps=reps, cases=cases,
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0 if all(c["verified"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
