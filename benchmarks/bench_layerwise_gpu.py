#!/usr/bin/env python
"""Layer-wise streaming behind a synthetic prefill on one GPU: two processes, the real PushWorker.

P runs a stand-in prefill of Qwen3-32B-shaped layers on its own main thread (the "engine
thread"): per layer real bf16 matmuls (fused QKV projection, output projection, the gated MLP)
with random weights (one set shared by all layers: the same work per layer, less memory) and a
real causal attention (``scaled_dot_product_attention``, K/V heads repeated for GQA), then it
writes that layer's K and V into its vLLM-shaped cache blocks (per layer
``(2, num_blocks, block_size, kv_heads, head_size)``, fragmented block ids). The values written
are the verification pattern of ``torch_pool.TensorPattern`` (the computed K/V values overflow
and could not be checked), precomputed before the timed run, so every mode writes the same bytes
with one indexed copy per layer and K/V. P's blocks are zeroed before each prefill, so a pack
taken before its layer was written would carry zeros to D.

Modes, interleaved with the order rotating, on one pair of processes:

* ``none``      -- the prefill alone: no transfer (the reference for the slowdown);
* ``layerwise`` -- ``prefill_started`` before the first layer, ``layer_saved`` after each layer's
                   attention, where vLLM calls ``save_kv_layer`` (``--save-after layer``: after
                   the whole layer, as in the first H200 run) -- an event; the transfer thread
                   packs that layer on its side stream and WRITEs each chunk once its layers are
                   packed; ``step_saved`` after the last layer; D registered before the prefill
                   began. With the hook after the attention the last layer's output projection
                   and MLP still run after it, so the last group's WRITE and unpack can end
                   before the prefill does: ``tail_ms`` < 0 means D had all KV that much early;
* ``staged``    -- the post-prefill staged path (today's): ``prefill_done`` after the prefill.

Per prefill: ``prefill_ms`` (CUDA events around the layers, on the engine's stream), ``t_end``
(``time.monotonic()`` when the engine thread's sync on the last layer's event returned: what vLLM
does before it samples), D's ``received`` time (its outcome collector, ``time.monotonic()``: one
clock for every process on Linux). ``tail_ms`` = received - t_end: what is left of the transfer
after the prefill. ``group_ms`` (kept from the first run's files): the staged path's tail
divided by its chunks; the chunks pipeline, so this understates one group's transfer. ``late``
runs layer-wise with D registering only after ``prefill_done``: its ``tail_ms`` is then D's
registration call -> received. Every transfer is verified on D's GPU (the pattern in the target
tokens, D's canary everywhere else).

Where the tail goes (``steps_ms_median``, same clock, ms from the tail's start): P stamps each
chunk's WRITE post (its start), D each chunk's notice. ``last_group_ms`` = the last chunk's WRITE
started -> D received: one layer group's WRITE plus D's unpack, inside the same transfer;
``tail_over_last_group`` is the tail over it. ``group_alone_ms``: after each case of several
chunks a post-prefill ``staged`` case of one chunk's size (``group_case``; 2,048 tokens for
16k at 512 MiB chunks) -- one group's whole transfer, control path and pack included;
``tail_over_group_alone`` is the tail over it (``--no-group-alone`` skips it). The goal "tail
<= 1.5x one group" reads best against ``group_alone_ms``; ``last_group_ms`` is the stricter
floor (the tail can never be below it).

On an H200 (docs/gpu.md has the set-up):

    UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y python3 benchmarks/bench_layerwise_gpu.py --budget-s 300

CPU smoke (host tensors, torch CPU ops; Qwen3-32B's layer widths, 4 layers, ~30 s):

    python benchmarks/bench_layerwise_gpu.py --device cpu --layers 4 --tokens 256

or a toy model (~5 s):

    python benchmarks/bench_layerwise_gpu.py --device cpu --layers 4 --hidden 256 \\
        --q-heads 4 --kv-heads 2 --head-size 64 --intermediate 512 --tokens 512 --reps 2

Writes ``benchmarks/results/gpu_layerwise.{json,md,meta.json}``.
"""

from __future__ import annotations

import argparse
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

from bench_staged_gpu import StagedBenchPeer  # noqa: E402
from bench_transfer_gpu import Pair, _versions, log, pool_blocks  # noqa: E402
from kv_push.common.testing.block_ids import fragmented_blocks  # noqa: E402
from kv_push.common.testing.peer_process import PeerError  # noqa: E402

SERVER = "bench_layerwise_gpu:LayerwisePeer"
MODES = ("none", "layerwise", "staged")


class LayerwisePeer(StagedBenchPeer):
    """``StagedBenchPeer`` plus the synthetic prefill (P's commands ``prepare_prefill`` and
    ``prefill``), run on the child's main thread: the engine thread of this stand-in."""

    def prepare_prefill(self, tokens: int, block_ids, seed: int, hidden: int, q_heads: int,
                        intermediate: int) -> dict:
        """Weights, activations' input and the per-layer pattern values for ``tokens``."""
        mem = self.memory
        torch = mem.torch
        g = mem.geometry
        dev, dt = mem.device, torch.bfloat16
        gen = torch.Generator(device=dev).manual_seed(seed)
        d, kvh = g.head_size, g.local_heads

        def w(*shape):
            return (torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32)
                    / shape[0] ** 0.5).to(dt)

        self._w = {"qkv": w(hidden, (q_heads + 2 * kvh) * d), "o": w(q_heads * d, hidden),
                   "gu": w(hidden, 2 * intermediate), "down": w(intermediate, hidden)}
        self._x0 = torch.randn(tokens, hidden, generator=gen, device=dev,
                               dtype=torch.float32).to(dt) * 0.1
        self._shape = (tokens, q_heads, kvh, d)
        nb = -(-tokens // g.block_size)
        self._ids = mem._ids(list(block_ids)[:nb])
        self._nb = nb
        self._vals = [[mem.pattern.values(seed, layer, kv, 0, nb * g.block_size)
                       .view(nb, g.block_size, kvh, d) for kv in range(g.kv_parts)]
                      for layer in range(g.num_layers)]
        mem._sync()
        return {"pattern_bytes": sum(v.numel() * 2 for lv in self._vals for v in lv)}

    def _layer(self, x, layer: int, saved=None, save_after: str = "attention"):
        """One decoder layer in vLLM's order: QKV projection, the layer's K/V written into its
        cache blocks (vLLM's cache write comes before its attention kernel), attention, then --
        with ``save_after="attention"`` -- ``saved(layer)`` where vLLM calls ``save_kv_layer``
        (the end of the attention op: the output projection and the MLP still follow), else
        after the whole layer."""
        torch = self.memory.torch
        F = torch.nn.functional
        w = self._w
        t, hq, hk, d = self._shape
        qkv = x @ w["qkv"]
        q = qkv[:, : hq * d].view(t, hq, d).transpose(0, 1)
        k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d).transpose(0, 1)
        v = qkv[:, (hq + hk) * d:].view(t, hk, d).transpose(0, 1)
        # the layer's KV into its cache blocks (the pattern: computed values overflow)
        for kv in range(len(self._vals[layer])):
            self.memory._part(layer, kv)[self._ids] = self._vals[layer][kv]
        rep = hq // hk
        a = F.scaled_dot_product_attention(q.unsqueeze(0), k.repeat_interleave(rep, 0)
                                           .unsqueeze(0), v.repeat_interleave(rep, 0)
                                           .unsqueeze(0), is_causal=True)
        if saved is not None and save_after == "attention":
            saved(layer)
        x = x + a.squeeze(0).transpose(0, 1).reshape(t, hq * d) @ w["o"]
        gu = x @ w["gu"]
        g_, u = gu.chunk(2, dim=-1)
        x = x + (F.silu(g_) * u) @ w["down"]
        if saved is not None and save_after == "layer":
            saved(layer)
        return x

    def tail_instrument(self) -> None:
        """Stamp every chunk's WRITE post on P and every chunk's notice and finished unpack on D
        (``time.monotonic()``, one clock for both processes): where the tail after the prefill
        goes. One list append per chunk, so the stamps cost nothing measurable. Idempotent."""
        if getattr(self, "_tail_ev", None) is not None:
            return
        ev = self._tail_ev = []
        clock = time.monotonic
        prod, dec = self.worker.producer, self.worker.decoder
        if prod is not None:
            post = prod._post

            def stamped_post(job):  # stamped before the post: with cuda_ipc the post is the copy
                if job.pending:
                    notice = job.pending[0][2]
                    ev.append(("p_post", clock(), notice.chunk, notice.chunks))
                post(job)

            prod._post = stamped_post
        if dec is not None and dec.staged is not None:
            rc = dec.staged
            on_chunk, poll = rc.on_chunk, rc.poll

            def stamped_on_chunk(wid, rank, msg, **k):
                ev.append(("d_notice", clock(), msg.chunk, msg.chunks))
                return on_chunk(wid, rank, msg, **k)

            def stamped_poll():
                out = poll()
                if any(ranks for _, ranks in out):
                    ev.append(("d_unpacked", clock(), -1, -1))
                return out

            rc.on_chunk, rc.poll = stamped_on_chunk, stamped_poll

    def take_tail_events(self) -> list:
        """The stamps since the last call (then cleared): ``(step, time, chunk, chunks)``."""
        out, self._tail_ev[:] = list(self._tail_ev), []
        return out

    def zero_blocks_of_prefill(self) -> None:
        mem = self.memory
        for layer in range(mem.geometry.num_layers):
            for kv in range(mem.geometry.kv_parts):
                mem._part(layer, kv)[self._ids] = 0
        mem._sync()

    def prefill(self, key: str, tid: str, block_ids, tokens: int, mode: str,
                save_after: str = "attention") -> dict:
        """The synthetic prefill; ``mode`` as in the module doc. Returns its timings."""
        mem = self.memory
        torch = mem.torch
        cuda = mem.device.type == "cuda"
        w = self.worker
        ids = list(block_ids)
        layers = mem.geometry.num_layers
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.monotonic()
        if mode == "layerwise":
            w.prefill_started(key, tid, ids, tokens)
        x = self._x0
        with torch.no_grad():
            saved = w.layer_saved if mode == "layerwise" else None
            for layer in range(layers):
                x = self._layer(x, layer, saved, save_after)
        if mode == "layerwise":
            w.step_saved()
        if cuda:
            end.record()
            end.synchronize()
        t_end = time.monotonic()
        out = {"t_end": t_end, "prefill_ms": start.elapsed_time(end) if cuda
               else (t_end - t0) * 1e3}
        if mode in ("layerwise", "staged", "late"):
            w.prefill_done(key, tid, ids, tokens)
        return out


def ratio(tail: float, group: float) -> float | None:
    """tail / group; None for a tail <= 0 (D had all KV before the prefill ended: no ratio to
    judge, the transfer was entirely off the critical path)."""
    return round(tail / group, 2) if tail > 0 and group > 0 else None


def tail_steps(events: list, t_ref: float, t_received: float) -> dict:
    """Where the tail went, from both peers' chunk stamps of one transfer (ms from ``t_ref``).

    ``last_post``: P posted the last chunk's WRITE (for layer-wise: the last layer packed);
    ``last_notice``: D took the last chunk's notice; ``last_group_ms``: the last chunk's WRITE
    posted -> D received, i.e. one layer group's WRITE + D's unpack + the report, measured inside
    this transfer; ``first_post`` shows when P started (layer-wise: during the prefill, < 0)."""
    posts = sorted((e[2], e[1]) for e in events if e[0] == "p_post")
    notices = sorted((e[2], e[1]) for e in events if e[0] == "d_notice")
    if not posts or not notices:
        return {}
    first_post = min(t for _, t in posts)
    last_post, last_notice = posts[-1][1], notices[-1][1]
    ms = lambda t: (t - t_ref) * 1e3  # noqa: E731
    return {"first_post": ms(first_post), "last_post": ms(last_post),
            "last_notice": ms(last_notice), "last_group_ms": (t_received - last_post) * 1e3}


def run_case(pair: Pair, tokens: int, rng, args, modes: list[str] | None = None) -> list[dict]:
    g = pair.pgeo
    n = -(-tokens // g.block_size)
    pblocks = fragmented_blocks(rng, pair.p_blocks, n)
    dblocks = fragmented_blocks(rng, pair.d_blocks, -(-tokens // pair.dgeo.block_size))
    seed = int(rng.integers(1 << 20))
    pair.P.call("prepare_prefill", tokens, pblocks, seed, args.hidden, args.q_heads,
                args.intermediate, timeout=600)
    if modes is None:
        modes = list(args.mode_list) + (["late"] if args.late else [])
    samples: dict[str, list[dict]] = {m: [] for m in modes}
    bad: dict[str, list[str]] = {m: [] for m in modes}
    for r in range(args.reps + 1):  # repetition 0 warms up (verified, not counted)
        k = r % len(modes)
        for mode in modes[k:] + modes[:k]:
            pair.seq += 1
            key, tid = f"lw-{pair.seq}", f"lw-xfer-{pair.seq}"
            pair.P.call("zero_blocks_of_prefill", timeout=120)
            moves = mode != "none"
            if moves:
                pair.D.call("canary", timeout=120)
            p0, d0 = pair.P.call("counters"), pair.D.call("counters")
            for peer in (pair.P, pair.D):
                peer.call("take_tail_events")
            if mode in ("layerwise", "staged"):  # D registered before the prefill began
                pair.D.call("expect_at", key, tid, 0, pair.address, dblocks, 0, tokens)
                pair.early += 1
                deadline = time.monotonic() + 30
                while pair.P.call("counters").get("registrations_early", 0) < pair.early:
                    if time.monotonic() > deadline:
                        raise PeerError("registration never reached P")
                    time.sleep(0.001)
            res = pair.P.call("prefill", key, tid, pblocks, tokens,
                              "layerwise" if mode == "late" else mode, args.save_after,
                              timeout=600)
            t_ref = res["t_end"]
            if mode == "late":
                t_ref = pair.D.call("expect_at", key, tid, 0, pair.address, dblocks, 0, tokens)
            sample = {"prefill_ms": res["prefill_ms"]}
            if moves:
                got = pair.D.call("outcome_at", key, 60.0, timeout=90)
                if got is None or got[0] != "received":
                    bad[mode].append(f"outcome {got}")
                    continue
                events = pair.P.call("take_tail_events") + pair.D.call("take_tail_events")
                if pair.P.call("wait_released", [key], 30.0) != [key]:
                    bad[mode].append("P kept its blocks")
                v = pair.D.call("verify", seed, tokens, dblocks, 0, timeout=300)
                if v["mismatch"] or v["canary"]:
                    bad[mode].append(f"verify {v}")
                p1, d1 = pair.P.call("counters"), pair.D.call("counters")
                dp = {k_: p1.get(k_, 0) - p0.get(k_, 0) for k_ in p1}
                dd = {k_: d1.get(k_, 0) - d0.get(k_, 0) for k_ in d1}
                want_lw = 1 if mode in ("layerwise", "late") else 0
                if dp.get("layerwise_transfers", 0) != want_lw or dd.get("staged_transfers") != 1:
                    bad[mode].append(f"path: P {dp.get('layerwise_transfers', 0)} layer-wise, "
                                     f"D {dd.get('staged_transfers')} staged")
                sample.update(tail_ms=(got[2] - t_ref) * 1e3,
                              chunks=int(dd.get("staged_chunks", 0)),
                              descriptors=int(dp.get("regions_written", 0)),
                              steps=tail_steps(events, t_ref, got[2]))
            if r > 0:
                samples[mode].append(sample)
        log(f"  {tokens} tok rep {r}: " + ", ".join(
            f"{m} {samples[m][-1]['prefill_ms']:.1f}/{samples[m][-1].get('tail_ms', 0):.2f} ms"
            for m in modes if samples[m] and r > 0))
    out = []
    base = statistics.median(s["prefill_ms"] for s in samples["none"]) if samples.get("none") \
        else None
    staged = samples.get("staged") or []
    per_chunk = (statistics.median(s["tail_ms"] / max(1, s["chunks"]) for s in staged)
                 if staged else None)
    for mode in modes:
        ss = samples[mode]
        if not ss:
            out.append({"tokens": tokens, "mode": mode, "verified": False, "errors": bad[mode]})
            continue
        pm = statistics.median(s["prefill_ms"] for s in ss)
        row = {"tokens": tokens, "block_size": g.block_size, "tp": 1, "mode": mode,
               "layers": g.num_layers, "prefill_ms_median": round(pm, 3),
               "prefill_ms_min": round(min(s["prefill_ms"] for s in ss), 3),
               "prefill_slowdown": round(pm / base - 1, 4) if base else None,
               "verified": not bad[mode], "errors": bad[mode][:3], "reps": len(ss)}
        if "tail_ms" in ss[0]:
            tails = [s["tail_ms"] for s in ss]
            row.update(tail_ms_median=round(statistics.median(tails), 3),
                       tail_ms_min=round(min(tails), 3), tail_ms_max=round(max(tails), 3),
                       chunks=ss[0]["chunks"], descriptors=ss[0]["descriptors"])
            steps = [s["steps"] for s in ss if s.get("steps")]
            if steps:  # medians of each step, ms from the tail's start
                row["steps_ms_median"] = {k: round(statistics.median(st[k] for st in steps), 3)
                                          for k in steps[0]}
                row["last_group_ms"] = row["steps_ms_median"]["last_group_ms"]
                row["tail_over_last_group"] = ratio(row["tail_ms_median"], row["last_group_ms"])
            if per_chunk:  # kept under its old name: the staged tail / its chunks
                row["group_ms"] = round(per_chunk, 3)
                row["tail_over_group"] = round(statistics.median(tails) / per_chunk, 2)
        out.append(row)
    return out


def group_alone_tokens(tokens: int, args) -> int:
    """Tokens of a request whose KV is exactly one staging chunk of a ``tokens`` request: the
    size of "one layer group" (the whole request when it fits in one chunk)."""
    per_tok = args.layers * 2 * args.kv_heads * args.head_size * 2
    layer_bytes = tokens * per_tok // args.layers
    layers = max(1, min(args.layers, (args.chunk_mib << 20) // layer_bytes))
    return tokens if layers >= args.layers else tokens * layers // args.layers


def add_group_alone(rows: list[dict], args) -> None:
    """``group_alone_ms`` -- the post-prefill staged tail of a request whose KV is one chunk of a
    row's size -- and the tail over it, on every row with a tail. The one-chunk request is a
    ``group_case`` of its own, or the case itself when it fits in one chunk."""
    alone = {r["tokens"]: r["tail_ms_median"] for r in rows
             if r["mode"] == "staged" and r.get("chunks") == 1 and "tail_ms_median" in r}
    for row in rows:
        if "tail_ms_median" not in row or row.get("group_case"):
            continue
        t = alone.get(group_alone_tokens(row["tokens"], args))
        if t:
            row["group_alone_ms"] = t
            row["tail_over_group_alone"] = ratio(row["tail_ms_median"], t)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tokens", default="16384,4096")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=64)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--intermediate", type=int, default=25600)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--no-late", dest="late", action="store_false",
                    help="skip the layer-wise run with D registering after the prefill")
    ap.add_argument("--no-group-alone", dest="group_alone", action="store_false",
                    help="skip the post-prefill staged transfer of a one-chunk request after "
                    "each case (the 'one layer group alone' reference)")
    ap.add_argument("--save-after", default="attention", choices=("attention", "layer"),
                    help="where layer_saved is called: after the attention (vLLM's "
                    "save_kv_layer; the output projection and MLP follow) or after the whole "
                    "layer (the first H200 run, 2026-12-04)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk-mib", type=int, default=512, help="staging_chunk_bytes (D decides)")
    ap.add_argument("--alloc", default="per_layer", choices=("per_layer", "pool"))
    ap.add_argument("--slack", type=float, default=1.25)
    ap.add_argument("--heartbeat-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting cases after this")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--name", default="gpu_layerwise")
    args = ap.parse_args(argv)
    args.tokens_list = [int(t) for t in args.tokens.split(",") if t]
    args.mode_list = [m for m in args.modes.split(",") if m]
    if "none" not in args.mode_list:
        args.mode_list.insert(0, "none")
    return args


def write_md(path: Path, rows: list[dict], meta: dict) -> None:
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    def over(r, k):
        early = r.get("tail_ms_median", 1) <= 0 and k in r
        return "done before the end" if early else f(r.get(k))

    lines = [f"# Layer-wise streaming behind a synthetic prefill ({meta['gpu']})", "",
             f"{meta['when']}; `{meta['command']}`", "",
             "| tokens | mode | prefill ms (median) | slowdown vs none | tail ms (median, min-max) "
             "| last WRITE posted | last notice on D | last group | tail / last group "
             "| one group alone | tail / group alone | chunks | descriptors | verified |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        tail = (f"{r['tail_ms_median']:.2f} ({r['tail_ms_min']:.2f}-{r['tail_ms_max']:.2f})"
                if "tail_ms_median" in r else "-")
        sd = r.get("prefill_slowdown")
        st = r.get("steps_ms_median") or {}
        mode = r["mode"] + (" (one chunk alone)" if r.get("group_case") else "")
        lines.append(
            f"| {r['tokens']} | {mode} | {f(r.get('prefill_ms_median'), '{:.1f}')} | "
            f"{f(None if sd is None else sd * 100, '{:+.2f}%')} | {tail} | "
            f"{f(st.get('last_post'))} | {f(st.get('last_notice'))} | "
            f"{f(r.get('last_group_ms'))} | {over(r, 'tail_over_last_group')} | "
            f"{f(r.get('group_alone_ms'))} | {over(r, 'tail_over_group_alone')} | "
            f"{r.get('chunks', '-')} | {r.get('descriptors', '-')} | {r['verified']} |")
    lines += ["", "All times in ms, medians over the measured repetitions. **tail**: layerwise and "
              "staged = the engine thread's sync on the last layer's event returned -> D's "
              "`received` outcome (D's unpack done); late = D's registration call -> received. "
              "**last WRITE posted** (the post's start), **last notice on D**: the last "
              "chunk's steps, from the same start; < 0: before it. **last group**: the last "
              "chunk's WRITE posted -> received (one layer "
              "group's WRITE + D's unpack, inside the same transfer). **one group alone**: the "
              "post-prefill staged tail of a one-chunk request of one chunk's size (control path "
              "+ pack + WRITE + unpack). The goal is tail <= 1.5x one group's transfer.", ""]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    rng = np.random.default_rng(args.seed)
    t_start = time.monotonic()
    per_tok = args.layers * 2 * args.kv_heads * args.head_size * 2
    biggest = max(args.tokens_list) * per_tok
    pool = int(biggest * 1.05) + (64 << 20)
    cfg = {"producer_staging_bytes": pool, "decoder_staging_bytes": pool,
           "staging_chunk_bytes": args.chunk_mib << 20}
    blocks = pool_blocks(max(args.tokens_list), args.block_size, args.slack)
    args.device = args.device
    pair = Pair(args, args.block_size, blocks, config=cfg, server=SERVER)
    pair.p_blocks = pair.d_blocks = blocks
    for peer in (pair.P, pair.D):
        peer.call("tail_instrument")
    rows: list[dict] = []
    skipped: list[str] = []

    def over() -> bool:
        return bool(args.budget_s) and time.monotonic() - t_start > args.budget_s

    try:
        for tokens in args.tokens_list:
            if over():
                skipped.append(f"{tokens} tokens: budget")
                continue
            log(f"case {tokens} tokens, block {args.block_size}, {args.layers} layers")
            try:
                rows += run_case(pair, tokens, rng, args)
            except PeerError as e:
                skipped.append(f"{tokens} tokens: {str(e).strip().splitlines()[-1]}")
                log(f"  failed: {e}")
            group = group_alone_tokens(tokens, args)
            if not args.group_alone or group == tokens or any(
                    r["tokens"] == group and r.get("group_case") for r in rows):
                continue
            if over():
                skipped.append(f"{group} tokens (one group alone): budget")
                continue
            log(f"case {group} tokens: one chunk alone, post-prefill staged")
            try:
                rows += [dict(r, group_case=True)
                         for r in run_case(pair, group, rng, args, modes=["staged"])]
            except PeerError as e:
                skipped.append(f"{group} tokens: {str(e).strip().splitlines()[-1]}")
                log(f"  failed: {e}")
        add_group_alone(rows, args)
    finally:
        info = pair.info
        pair.close()
    meta = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["python3", "benchmarks/bench_layerwise_gpu.py",
                                 *(argv if argv is not None else sys.argv[1:])]),
            "gpu": info.get("gpu", info.get("device")), "info": info, "versions": _versions(),
            "python": platform.python_version(), "args": {k: v for k, v in vars(args).items()},
            "staging_bytes": pool, "skipped": skipped,
            "seconds": round(time.monotonic() - t_start, 1)}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{args.name}.meta.json").write_text(json.dumps(meta, indent=1, default=str))
    write_md(out / f"{args.name}.md", rows, meta)
    log((out / f"{args.name}.md").read_text())
    return 0 if rows and all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
