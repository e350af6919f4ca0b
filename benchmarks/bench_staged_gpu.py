#!/usr/bin/env python
"""Staged push vs region push vs pull on one GPU, two processes, the real PushWorker path.

Shares its peers with ``bench_transfer_gpu.py`` (``Pair``: P and D spawned together, each a
``BenchPeerServer`` over ``torch_pool.TorchMemory``: vLLM-FlashAttention-shaped per-layer KV
tensors on ``cuda:0``, ``describe_kv_caches(backend=CudaBackend())``, a real ``PushWorker``, the
pattern fill and the on-GPU verification with canaries, and a second NIXL agent for pull). Here both workers also own a staging pool
(``producer_staging_bytes`` / ``decoder_staging_bytes``, allocated by ``CudaBackend.alloc_staging``
and registered with the agent), and per transfer the decoder's staging is switched on or off, so
one pair of processes measures, interleaved with the order rotating:

* ``regions`` -- today's push: one NIXL descriptor per contiguous (layer, K/V, token run);
* ``staged``  -- D reserves a slot, P packs on a side stream into its pool, WRITEs a few large
                 chunks (``--chunk-mib``), D unpacks each chunk on a side stream and reports
                 ``received`` after the last unpack completed;
* ``pull``    -- vLLM NixlConnector-style READ of per-block descriptors (same geometry only).

The critical path is P's ``prefill_done`` call -> D's ``received`` outcome (D registered first;
``time.monotonic`` in both children). Every transfer (warm-up included) is verified on D's GPU:
each element of the target tokens against the pattern, every other element of D's pool against a
canary; plus a negative control per case. A ``regions``/``staged`` sample only counts if D's
counters show that path was taken (``staged_transfers`` moved, no ``staged_fallback``).
``copy_GBps`` is the same-run contiguous device ``copy_`` rate of the case's bytes (the ceiling).

Shapes: Qwen3-32B (64 layers, 8 KV heads, head size 128, bf16): ``tp`` 1 is the whole model on one
rank; ``tp`` 8 is one rank of TP 8 (1 KV head: the same bytes and descriptors per rank, modelled
as a 1-KV-head model at TP 1). Block sizes 16 and 128 on both sides, and a heterogeneous D (P block
16 NHD -> D block 32 HND; no pull there). Block ids fragmented independently on P and D.

Full run on an H200 (docs/gpu.md has the setup; ~5-7 min with the budget cutting what is left):

    UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y python3 benchmarks/bench_staged_gpu.py --budget-s 420

Debug / CPU (host tensors, HostBackend, numpy staging pools):

    python benchmarks/bench_staged_gpu.py --device cpu --layers 4 --head-size 16 \\
        --tokens 256,1024 --reps 2 --chunk-mib 1

Writes ``benchmarks/results/gpu_staged.json`` (a list of cases: ``tokens``, ``block_size``,
``tp``, ``mode``, ``critical_ms_median``, ``copy_GBps``, ``descriptors``, ``verified`` and more),
``gpu_staged.meta.json`` (machine, arguments, skipped and failed cases) and ``gpu_staged.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # spawned children import this module

from bench_transfer_gpu import QWEN3_32B, Pair, _versions, log, pool_blocks  # noqa: E402
from kv_push.common.testing.bench_peer_server import BenchPeerServer  # noqa: E402
from kv_push.common.testing.block_ids import fragmented_blocks  # noqa: E402
from kv_push.common.testing.peer_process import PeerError  # noqa: E402

SERVER = "bench_staged_gpu:StagedBenchPeer"
MODES = ("regions", "staged", "pull")


class StagedBenchPeer(BenchPeerServer):
    """``BenchPeerServer`` plus the decoder's run-time staging switch."""

    def set_staged(self, on: bool) -> None:
        dec = self.worker.decoder
        if dec is None or dec.staged is None:
            if on:
                raise RuntimeError("this decoder has no staging pool")
            return
        self.worker.thread.call(lambda: setattr(dec.staged, "enabled", bool(on)), 10.0)

    def set_kernel(self, kernel: str) -> str:
        """Switch this worker's pack/unpack kernels (``triton`` | ``torch``) between transfers."""
        roles = [r for r in (self.worker.producer, self.worker.decoder)
                 if r is not None and getattr(r, "staged", None) is not None]

        def switch() -> str:
            for r in roles:
                r.staged.ops.set_kernel(kernel)
            return roles[0].staged.ops.kernel if roles else ""
        return self.worker.thread.call(switch, 10.0)

    def kernel(self) -> str:
        roles = [r for r in (self.worker.producer, self.worker.decoder)
                 if r is not None and getattr(r, "staged", None) is not None]
        return roles[0].staged.ops.kernel if roles else ""

    def staged_instrument(self) -> None:
        """Record the staged path's steps (monotonic, system-wide clock: comparable between P
        and D): P's start of the staged send and its packs enqueued, each chunk seen packed,
        WRITE posts; D's notices, unpacks enqueued, the last unpack seen complete."""
        if getattr(self, "_staged_ev", None) is not None:
            return
        self.instrument()
        ev = self._staged_ev = []
        clock = time.monotonic
        prod = self.worker.producer
        if prod is not None and prod.staged is not None:
            st = prod.staged
            o_start, o_packed = st.start, st.packed
            seen = set()

            def start(*a, **k):
                ev.append(("p_start", clock()))
                out = o_start(*a, **k)
                ev.append(("p_enqueued", clock()))
                return out

            def packed(send, index):
                ok = o_packed(send, index)
                if ok and (id(send), index) not in seen:
                    seen.add((id(send), index))
                    ev.append(("p_packed", clock()))
                return ok

            st.start, st.packed = start, packed
        dec = self.worker.decoder
        if dec is not None and dec.staged is not None:
            rc = dec.staged
            o_chunk, o_poll = rc.on_chunk, rc.poll

            def on_chunk(*a, **k):
                ev.append(("d_notice", clock()))
                out = o_chunk(*a, **k)
                ev.append(("d_unpack_enqueued", clock()))
                return out

            def poll():
                out = o_poll()
                if any(newly for _, newly in out):
                    ev.append(("d_unpacked", clock()))
                return out

            rc.on_chunk, rc.poll = on_chunk, poll

    def take_staged_events(self) -> dict:
        """{step: [first, last]} since the last call (then cleared)."""
        out: dict = {}
        evs = list(self._staged_ev or [])
        evs += [e for e in self.events if e[0] in ("thread_start", "descs_start", "init_start",
                                                  "init_end", "post_start", "post_end")]
        self._staged_ev[:] = []
        del self.events[:]
        for e in evs:
            name, t = e[0], e[1]
            if name in out:
                out[name][0] = min(out[name][0], t)
                out[name][1] = max(out[name][1], t)
            else:
                out[name] = [t, t]
        return out

    def staging_info(self) -> dict:
        return {side: mem.nbytes for side, mem in self.worker.staging.items()}


# -- the cases -------------------------------------------------------------------------------------

class Shape:
    """One pair of processes: P block size ``bs``, D block size/order, KV heads per rank."""

    def __init__(self, tp: int, bs: int, d_bs: int | None = None, d_order: str = "NHD"):
        self.tp, self.bs = tp, bs
        self.d_bs, self.d_order = d_bs or bs, d_order
        self.hetero = (self.d_bs, self.d_order) != (bs, "NHD")

    @property
    def label(self) -> str:
        d = f" -> D bs{self.d_bs} {self.d_order}" if self.hetero else ""
        return f"TP{self.tp} bs{self.bs}{d}"


def shapes(args) -> list[Shape]:
    out = []
    for tp in args.tp_list:
        for bs in args.bs_list:
            out.append(Shape(tp, bs))
        if args.hetero:
            out.append(Shape(tp, 16, 32, "HND"))
    # most telling first: the budget cuts from the end
    return sorted(out, key=lambda s: (s.tp != 1, s.hetero, s.bs))


def per_token(args, heads: int) -> int:
    return args.layers * 2 * heads * args.head_size * 2


def counters(peer) -> dict:
    return peer.call("counters")


def run_transfer(pair: Pair, mode: str, pblocks, dblocks, tokens: int,
                 kernel: str | None = None) -> dict:
    """One measured transfer of ``mode``; raises PeerError when it failed or took another path."""
    if kernel is not None and getattr(pair, "kernel", None) != kernel:
        for peer in (pair.P, pair.D):
            peer.call("set_kernel", kernel)
        pair.kernel = kernel
    if mode == "pull":
        s = pair.pull(pblocks, dblocks, tokens)
        return {"total": s["total"], "descriptors": s["descs"], "path_ok": True}
    pair.D.call("set_staged", mode == "staged")
    p0, d0 = counters(pair.P), counters(pair.D)
    if getattr(pair, "phases", False):
        pair.P.call("take_staged_events")
        pair.D.call("take_staged_events")
    s = pair.push(pblocks, dblocks, tokens)
    p1, d1 = counters(pair.P), counters(pair.D)
    phases = None
    if getattr(pair, "phases", False) and mode == "staged":
        ev = {**pair.P.call("take_staged_events"), **pair.D.call("take_staged_events")}
        t0 = s["t0"]
        phases = {f"{k}_{'first' if i == 0 else 'last'}": round((v[i] - t0) * 1e3, 3)
                  for k, v in ev.items() for i in (0, 1) if i == 0 or v[1] != v[0]}
        phases["outcome"] = round(s["total"] * 1e3, 3)
    staged = d1.get("staged_transfers", 0) - d0.get("staged_transfers", 0)
    fell = {k: d1[k] - d0.get(k, 0) for k in d1
            if k.startswith("staged_fallback{") and d1[k] != d0.get(k, 0)}
    fell.update({k: p1[k] - p0.get(k, 0) for k in p1
                 if k.startswith("staged_fallback{") and p1[k] != p0.get(k, 0)})
    path_ok = staged > 0 and not fell if mode == "staged" else staged == 0
    if mode == "staged" and kernel is not None:  # the kernels that ran: both sides counted them
        key = f"staging_launches{{{kernel}}}"
        launches = {side: int(b.get(key, 0) - a.get(key, 0))
                    for side, a, b in (("P", p0, p1), ("D", d0, d1))}
        path_ok = path_ok and all(launches.values())
    else:
        launches = None
    return {"total": s["total"], "path_ok": path_ok, "fallbacks": fell, "launches": launches,
            "phases": phases,
            "descriptors": int(p1.get("regions_written", 0) - p0.get("regions_written", 0))}


def region_estimate(shape: Shape, tokens: int, args, heads: int) -> int:
    """Upper bound of the region path's descriptors (known before running it): one per (layer,
    K/V, token, head) into HND with several heads, else one per (layer, K/V, P block)."""
    if shape.d_order == "HND" and heads > 1:
        return tokens * args.layers * 2 * heads
    return -(-tokens // min(shape.bs, shape.d_bs)) * args.layers * 2


def run_case(pair: Pair, shape: Shape, tokens: int, rng, args, copy_gbps: float,
             notes: list) -> list[dict]:
    heads = 1 if shape.tp == 8 else args.kv_heads
    nbytes = tokens * per_token(args, heads)
    n, dn = -(-tokens // shape.bs), -(-tokens // shape.d_bs)
    pblocks = fragmented_blocks(rng, pair.p_blocks, n)
    dblocks = fragmented_blocks(rng, pair.d_blocks, dn)
    seed = int(rng.integers(1 << 20))
    pair.P.call("fill", seed, tokens, pblocks, timeout=600)
    est = region_estimate(shape, tokens, args, heads)
    runs: list[tuple[str, str | None]] = []
    reps = {}
    for m in args.mode_list:
        if m == "pull" and not (pair.pull_ok and not shape.hetero):
            continue
        if m == "regions" and est > args.max_region_descs:
            notes.append(f"{shape.label} {tokens} tok regions: not run, ~{est} descriptors > "
                         f"--max-region-descs {args.max_region_descs} (~7 us each: "
                         f"{est * 7e-6:.0f} s per transfer)")
            continue
        for k in (args.kernel_list if m == "staged" else [None]):
            runs.append((m, k))
            reps[(m, k)] = args.reps
            if m == "regions" and est > args.slow_region_descs:
                reps[(m, k)] = 1
                notes.append(f"{shape.label} {tokens} tok regions: 1 measured repetition "
                             f"(~{est} descriptors > --slow-region-descs "
                             f"{args.slow_region_descs})")
    samples = {r: [] for r in runs}
    info = {r: {"transfers": 0, "mismatch": 0, "canary": 0, "wrong_path": 0, "descriptors": None,
                "fallbacks": {}, "launches": None, "phases": []} for r in runs}
    errors: dict = {}
    for r in range(args.reps + 1):  # repetition 0: the warm-up (verified, not counted)
        k = r % len(runs)
        for run in runs[k:] + runs[:k]:
            m, kernel = run
            if run in errors or r > reps[run]:
                continue
            pair.D.call("canary", timeout=600)
            try:
                s = run_transfer(pair, m, pblocks, dblocks, tokens, kernel)
            except PeerError as e:
                errors[run] = str(e).strip().splitlines()[-1][:300]
                log(f"    !! {m} {kernel or ''} failed: {errors[run]}")
                continue
            v = pair.D.call("verify", seed, tokens, dblocks, 0, m == "pull", timeout=600)
            c = info[run]
            c["transfers"] += 1
            c["mismatch"] += v["mismatch"]
            c["canary"] += v["canary"]
            c["wrong_path"] += not s["path_ok"]
            c["descriptors"] = s["descriptors"]
            c["launches"] = s.get("launches")
            for key, val in s.get("fallbacks", {}).items():
                c["fallbacks"][key] = c["fallbacks"].get(key, 0) + val
            if v["mismatch"] or v["canary"] or not s["path_ok"]:
                log(f"    !! {m} {kernel or ''}: {v['mismatch']} elements wrong, {v['canary']} "
                    f"canary elements hit, path {'ok' if s['path_ok'] else 'WRONG ' + str(s.get('fallbacks'))}")
            if r > 0:
                samples[run].append(s["total"])
                if s.get("phases"):
                    c["phases"].append(s["phases"])
    neg = pair.D.call("verify", seed + 1, tokens, dblocks, timeout=600)["mismatch"]
    out = []
    for run in runs:
        m, kernel = run
        c, xs = info[run], samples[run]
        med = statistics.median(xs) if xs else float("nan")
        out.append({
            "tokens": tokens, "block_size": shape.bs, "tp": shape.tp, "mode": m,
            "kernel": kernel,
            "critical_ms_median": round(med * 1e3, 3) if xs else None,
            "copy_GBps": round(copy_gbps, 1) if copy_gbps else None,
            "descriptors": c["descriptors"],
            "verified": bool(c["transfers"] and not c["mismatch"] and not c["canary"]
                             and not c["wrong_path"] and neg > 0 and run not in errors),
            "d_block_size": shape.d_bs, "d_token_order": shape.d_order, "kv_heads_per_rank": heads,
            "bytes": nbytes,
            "GBps": round(nbytes / med / 1e9, 2) if xs else None,
            "of_copy": round(nbytes / med / 1e9 / copy_gbps, 4) if xs and copy_gbps else None,
            "min_ms": round(min(xs) * 1e3, 3) if xs else None,
            "samples_ms": [round(x * 1e3, 3) for x in xs],
            "launches": c["launches"],
            "phases_ms_median": {k: round(statistics.median(p[k] for p in c["phases"]
                                                           if k in p), 3)
                                 for k in sorted({k for p in c["phases"] for k in p})}
            if c["phases"] else None,
            "transfers_verified": c["transfers"], "negative_control_mismatch": neg,
            "fallbacks": c["fallbacks"], "error": errors.get(run),
        })
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--block-sizes", default="16,128")
    ap.add_argument("--tp", default="1,8", help="1 (whole model per rank) and/or 8 (one rank)")
    ap.add_argument("--no-hetero", dest="hetero", action="store_false",
                    help="leave out the heterogeneous D (block 32, HND)")
    ap.add_argument("--layers", type=int, default=QWEN3_32B["num_layers"])
    ap.add_argument("--kv-heads", type=int, default=QWEN3_32B["num_kv_heads"])
    ap.add_argument("--head-size", type=int, default=QWEN3_32B["head_size"])
    ap.add_argument("--chunk-mib", type=float, default=512.0,
                    help="staging_chunk_bytes in MiB (layers per chunk follow from it)")
    ap.add_argument("--reps", type=int, default=3, help="measured repetitions per mode")
    ap.add_argument("--alloc", default="per_layer", choices=("per_layer", "pool"),
                    help="per_layer: one allocation per layer (as vLLM); pool: one allocation")
    ap.add_argument("--slack", type=float, default=1.125, help="KV pool blocks / blocks needed")
    ap.add_argument("--kernels", default="auto",
                    help="staged pack/unpack kernels to compare, e.g. triton,torch (auto: "
                         "triton,torch on CUDA when triton imports, torch on CPU)")
    ap.add_argument("--max-region-descs", type=int, default=1_100_000,
                    help="skip the region path where it would post more descriptors (recorded)")
    ap.add_argument("--slow-region-descs", type=int, default=200_000,
                    help="above this many region descriptors measure 1 repetition only")
    ap.add_argument("--modes", default=",".join(MODES), help="subset of regions,staged,pull")
    ap.add_argument("--phases", action="store_true",
                    help="record the staged path's steps per transfer (phases_ms_median)")
    ap.add_argument("--idle-poll-s", type=float, default=None,
                    help="idle_poll_s for both workers (default: the config's)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="stop starting cases after this many seconds (0: no limit)")
    ap.add_argument("--heartbeat-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--name", default="gpu_staged", help="output file stem")
    args = ap.parse_args(argv)
    args.token_list = [int(t) for t in args.tokens.split(",")]
    args.bs_list = [int(b) for b in args.block_sizes.split(",")]
    args.tp_list = [int(t) for t in args.tp.split(",")]
    args.mode_list = [m.strip() for m in args.modes.split(",")]
    if any(m not in MODES for m in args.mode_list):
        ap.error(f"--modes takes {', '.join(MODES)}")
    if args.kernels == "auto":
        ok = args.device == "cuda" and importlib.util.find_spec("triton") is not None
        args.kernel_list = ["triton", "torch"] if ok else ["torch"]
    else:
        args.kernel_list = [k.strip() for k in args.kernels.split(",")]
        if any(k not in ("triton", "torch") for k in args.kernel_list):
            ap.error("--kernels takes triton and/or torch")
    if any(t not in (1, 8) for t in args.tp_list):
        ap.error("--tp takes 1 and/or 8")
    return args


def start_pair(args, shape: Shape) -> Pair:
    heads = 1 if shape.tp == 8 else args.kv_heads
    top = max(args.token_list)
    p_blocks = pool_blocks(top, shape.bs, args.slack)
    d_blocks = pool_blocks(top, shape.d_bs, args.slack)
    pool = top * per_token(args, heads) + (8 << 20)  # the largest request's slot, and some
    config = {"staged": "auto", "producer_staging_bytes": pool, "decoder_staging_bytes": pool,
              "staging_chunk_bytes": int(args.chunk_mib * 2**20)}
    if args.idle_poll_s is not None:
        config["idle_poll_s"] = args.idle_poll_s
    pair = Pair(args, shape.bs, p_blocks, kv_heads=heads, config=config, server=SERVER,
                d={"block_size": shape.d_bs, "token_order": shape.d_order,
                   "num_blocks": d_blocks})
    pair.p_blocks, pair.d_blocks = p_blocks, d_blocks
    pair.phases = bool(args.phases)
    if args.phases:
        for peer in (pair.P, pair.D):
            peer.call("staged_instrument")
    return pair


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    rng = np.random.default_rng(args.seed)
    t0 = time.monotonic()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cases: list[dict] = []
    skipped: list[str] = []
    notes: list[str] = []
    failed: list[dict] = []
    meta: dict = {"started": started, "command": " ".join([Path(sys.executable).name, *sys.argv]),
                  "args": {k: v for k, v in vars(args).items() if not k.endswith("_list")},
                  "peers": {}, "copy_GBps": {}}
    todo = shapes(args)
    log(f"bench_staged_gpu: {len(todo)} shapes x {len(args.token_list)} sizes on {args.device}, "
        f"{args.reps} reps of {', '.join(MODES)}; budget {args.budget_s or 'none'} s")

    def over() -> bool:
        return bool(args.budget_s) and time.monotonic() - t0 > args.budget_s

    def write() -> None:
        meta.update(seconds=round(time.monotonic() - t0, 1), skipped=skipped, failed=failed,
                    notes=notes,
                    machine={"cpus": os.cpu_count(), "platform": platform.platform(),
                             "python": platform.python_version(), "versions": _versions(),
                             "ucx_env": {k: v for k, v in os.environ.items()
                                         if k.startswith("UCX_")}})
        (out / f"{args.name}.json").write_text(json.dumps(cases, indent=1))
        (out / f"{args.name}.meta.json").write_text(json.dumps(meta, indent=1))
        (out / f"{args.name}.md").write_text(markdown(cases, meta))

    for shape in todo:
        if over():
            skipped += [f"{shape.label} {t} tok" for t in args.token_list]
            continue
        t = time.monotonic()
        log(f"[{shape.label}] starting P and D...")
        try:
            pair = start_pair(args, shape)
        except PeerError as e:
            log(f"  could not start: {str(e).strip().splitlines()[-1]}")
            failed.append({"shape": shape.label, "error": str(e)[-2000:]})
            write()
            continue
        try:
            meta["peers"][shape.label] = {**pair.info, "staging": pair.P.call("staging_info"),
                                          "d_staging": pair.D.call("staging_info")}
            log(f"  ready in {time.monotonic() - t:.1f}s")
            for tokens in args.token_list:
                if over():
                    skipped.append(f"{shape.label} {tokens} tok")
                    continue
                heads = 1 if shape.tp == 8 else args.kv_heads
                nbytes = tokens * per_token(args, heads)
                key = str(nbytes)
                if key not in meta["copy_GBps"]:
                    meta["copy_GBps"][key] = pair.P.call("copy_rate", nbytes, timeout=300)
                copy = meta["copy_GBps"][key]
                t = time.monotonic()
                try:
                    got = run_case(pair, shape, tokens, rng, args, copy, notes)
                except PeerError as e:
                    log(f"  {tokens} tok FAILED: {str(e).strip().splitlines()[-1]}")
                    failed.append({"shape": shape.label, "tokens": tokens, "error": str(e)[-2000:]})
                    continue
                cases.extend(got)
                write()
                log(f"  {tokens:>6} tok ({nbytes / 2**20:.0f} MiB, copy {copy:.0f} GB/s): " +
                    " | ".join(f"{c['mode']}{'/' + c['kernel'] if c['kernel'] else ''} "
                               f"{c['critical_ms_median']} ms "
                               f"({c['descriptors']} descs{'' if c['verified'] else ', NOT VERIFIED'})"
                               for c in got) + f"  [{time.monotonic() - t:.0f}s]")
        finally:
            pair.close()
    write()
    log(f"\nwrote {out / (args.name + '.json')} (+ .meta.json, .md) in "
        f"{time.monotonic() - t0:.0f}s; skipped {len(skipped)}, failed {len(failed)}\n")
    log(markdown(cases, meta))
    ok = bool(cases) and not failed and all(c["verified"] for c in cases)
    return 0 if ok else 1


def markdown(cases: list[dict], meta: dict) -> str:
    L = ["# Staged push vs region push vs pull, one GPU, two processes\n",
         f"Command: `{meta['command']}`; started {meta['started']}, "
         f"{meta.get('seconds', 0):.0f} s. Versions: {meta.get('machine', {}).get('versions')}. "
         "Critical path = P's prefill-done -> D's received (unpack included), median ms of "
         f"{meta['args']['reps']} verified repetitions after a verified warm-up; copy = same-run "
         "contiguous device copy_ of the same bytes.\n",
         "| shape | tokens | MiB | mode | kernel | ms | GB/s | of copy | descriptors | "
         "launches P/D | verified |",
         "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for c in cases:
        shape = f"TP{c['tp']} bs{c['block_size']}" + (
            f" -> bs{c['d_block_size']} {c['d_token_order']}"
            if (c["d_block_size"], c["d_token_order"]) != (c["block_size"], "NHD") else "")
        la = c.get("launches") or {}
        L.append(f"| {shape} | {c['tokens']} | {c['bytes'] / 2**20:.0f} | {c['mode']} | "
                 f"{c.get('kernel') or ''} | {c['critical_ms_median']} | {c['GBps']} | "
                 f"{c['of_copy']} | {c['descriptors']} | "
                 f"{'/'.join(str(la[k]) for k in ('P', 'D')) if la else ''} | "
                 f"{'yes' if c['verified'] else 'NO'} |")
    if meta.get("skipped"):
        L.append(f"\nSkipped (budget): {', '.join(meta['skipped'])}")
    for n in meta.get("notes", []):
        L.append(f"\nNote: {n}")
    for f in meta.get("failed", []):
        L.append(f"\nFailed: {f.get('shape')} {f.get('tokens', '')}: "
                 f"{f['error'].strip().splitlines()[-1][:200]}")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
