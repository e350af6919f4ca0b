#!/usr/bin/env python
"""Push vs pull on one GPU: real VRAM -> VRAM through NIXL UCX (cuda_ipc), two processes.

The GPU counterpart of ``bench_transfer.py``. P (producer) and D (decoder) are two spawned
processes on the same GPU (``cuda:0``). Each allocates vLLM-FlashAttention-shaped KV: per layer
one tensor ``(2, num_blocks, block_size, kv_heads, head_size)`` bf16 (``kv_split``; the test also
uses ``(num_blocks, 2, ...)``, ``blocks_first``, and head-major permuted views), describes it
with ``describe_kv_caches(..., backend=CudaBackend())`` and runs a real ``PushWorker`` over it --
the production code path: side-channel handshake, registration notification, rendezvous,
``plan_writes``, one NIXL WRITE with the ``WriteDone`` notification, release.

P fills its blocks with a deterministic function of (seed, layer, K/V, token, global head,
element) computed on the GPU (bf16 bit patterns); D fills its whole pool with a canary before
every transfer and afterwards checks on the GPU that every received (layer, K/V, token, head)
vector equals the function and that every byte outside the target tokens still holds the
canary. Only two counts come back to the host.

Methods, per case (interleaved, order rotating, every transfer verified):

* push        -- D registered earlier; from P's ``prefill_done`` call to D's ``received``
                 outcome (``time.monotonic`` stamps inside the children: one clock);
* pull        -- vLLM NixlConnector-style: P's block ids reach D by one localhost HTTP request
                 (the relay hop), D builds one descriptor per (layer, K/V, block) on each side
                 and posts a NIXL READ carrying a notification to P; from P's prefill-done to
                 the later of "D's READ is DONE" and "P got the notification";
* bare_write  -- the push plan's regions as one WRITE, request built in advance, post + poll.

P and D run ``kv_push.common.testing.bench_peer_server.BenchPeerServer`` over torch memory
(``common/testing/torch_pool.py``); pull and bare transfers use its second NIXL agent
(``pull_peer.AgentThread``) over the same registered memory.

    UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y python benchmarks/bench_transfer_gpu.py   # H200: full run
    python benchmarks/bench_transfer_gpu.py --device cpu --layers 4 --tokens 256,1024 --reps 2
                                                                   # host tensors, to debug

Writes ``benchmarks/results/transfer_gpu.json`` and ``transfer_gpu.md`` (``--out-dir``).

On a GPU without active NVLinks (one GPU in a VM, PCIe cards) UCX disables cuda_ipc GET by
default, so pull's READ falls back to a path of ~0.4 GB/s while WRITE uses cuda_ipc; set
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` for a like-for-like pull baseline (see docs/gpu.md).
``--alloc pool`` puts all layers in one allocation instead of one per layer (as vLLM does).
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

from kv_push.common.layout import plan_writes
from kv_push.common.testing.bench_peer_server import SERVER
from kv_push.common.testing.block_ids import fragmented_blocks
from kv_push.common.testing.peer_process import PeerError, PeerSpec, start_pair

HERE = Path(__file__).resolve().parent
METHODS = ("push", "pull", "bare_write")
QWEN3_32B = dict(num_layers=64, num_kv_heads=8, head_size=128, dtype_bytes=2)


def log(msg: str) -> None:
    print(msg, flush=True)


def per_token_bytes(a) -> int:
    return a.layers * 2 * a.kv_heads * a.head_size * 2


def pool_blocks(tokens: int, bs: int, slack: float) -> int:
    return int(math.ceil(-(-tokens // bs) * slack)) + 2


def wait_counter(peer, name: str, target: float, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while peer.call("counters").get(name, 0) < target:
        if time.monotonic() > deadline:
            raise PeerError(f"counter {name} never reached {target}")
        time.sleep(0.001)


class Pair:
    """P and D for one block size, both push workers and both second agents connected.

    By default both sides are kv_split NHD with ``args``' model shape. ``kv_heads`` overrides
    the model's KV heads; ``d`` overrides D's PeerSpec fields (e.g. block_size, token_order,
    num_blocks); ``config`` is added to both workers' PushConfig; ``server`` is the child class
    ("module:Class", a ``BenchPeerServer``).
    """

    def __init__(self, args, bs: int, blocks: int, *, kv_heads: int | None = None,
                 d: dict | None = None, config: dict | None = None, server: str = SERVER):
        # torch tensors on the device, as vLLM allocates them (common/testing/torch_pool.py)
        common = dict(placement="kv_split", num_layers=args.layers,
                      num_kv_heads=kv_heads or args.kv_heads, head_size=args.head_size,
                      dtype_bytes=2, block_size=bs, num_blocks=blocks, token_order="NHD",
                      memory=f"torch:{args.device}", alloc=args.alloc)
        hb = {"heartbeat_interval_s": args.heartbeat_s, **(config or {})}
        self.P, self.D = start_pair(
            PeerSpec(role="producer", engine_id="gpubench-prefill",
                     config={"side_channel_port": 0, **hb}, **common),
            PeerSpec(role="decoder", engine_id="gpubench-decode", config=hb,
                     **{**common, **(d or {})}),
            server=server)
        self.address = self.P.call("address")
        self.pgeo, self.dgeo = self.P.call("geometry"), self.D.call("geometry")
        self.info = self.P.call("info")
        self.pull_ok = True
        try:
            self.P.call("pull_add_peer", self.D.call("pull_agent_metadata"), self.dgeo)
            self.D.call("pull_add_peer", self.P.call("pull_agent_metadata"), self.pgeo)
            self.port = self.D.call("http_port")
        except PeerError as e:
            self.pull_ok = False
            self.pull_error = str(e).strip().splitlines()[-1]
            log(f"  second agents could not connect: {self.pull_error}")
        self.early = 0
        self.seq = 0

    def close(self) -> None:
        self.D.close()
        self.P.close()

    def push(self, pblocks, dblocks, tokens) -> dict:
        self.seq += 1
        key, tid = f"push-{self.seq}", f"xfer-push-{self.seq}"
        self.D.call("expect_at", key, tid, 0, self.address, dblocks, 0, tokens)
        self.early += 1
        wait_counter(self.P, "registrations_early", self.early)
        t0 = self.P.call("prefill_done_at", key, tid, pblocks, tokens)
        got = self.D.call("outcome_at", key, 60.0, timeout=90)
        if got is None or got[0] != "received":
            raise PeerError(f"push {key}: {got}")
        if self.P.call("wait_released", [key], 30.0) != [key]:
            raise PeerError(f"push {key}: P never released its blocks")
        return {"total": got[2] - t0, "t0": t0}

    def pull(self, pblocks, dblocks, tokens) -> dict:
        self.seq += 1
        key = f"pull-{self.seq}"
        self.D.call("pull_expect", key, dblocks)
        t0 = self.P.call("pull_prefill_done", key, pblocks, tokens, self.port, 0.0)  # spin, as measured
        res = self.D.call("pull_result", key, 60.0, timeout=90)
        tn = self.P.call("pull_notif_at", key, 60.0)
        if res is None or res.get("state") != "DONE" or tn is None:
            raise PeerError(f"pull {key}: D {res}, P notified at {tn}")
        return {"total": max(res["done"], tn) - t0, "d_has_data": res["done"] - t0,
                "descs": res["descs"],
                "seg": {"relay_http": res["http"] - t0, "desc_build": res["desc"] - res["start"],
                        "post": res["post"] - res["desc"], "read_to_done": res["done"] - res["post"],
                        "done_to_p_notif": tn - res["done"]}}

    def bare_write(self, pblocks, dblocks, tokens) -> dict:
        self.D.call("progress", True)
        try:
            prep = self.P.call("bare_prepare", "WRITE", pblocks, dblocks, tokens, timeout=300)
            r = self.P.call("bare_run", "WRITE", timeout=90)
            self.P.call("bare_release", "WRITE")
        finally:
            self.D.call("progress", False)
        if r["state"] != "DONE":
            raise PeerError(f"bare WRITE: {r}")
        return {"total": r["done"] - r["start"], "descs": prep["descs"],
                "seg": {"post": r["posted"] - r["start"], "post_to_done": r["done"] - r["posted"],
                        "prep_plan": prep["plan_s"], "prep_dlists": prep["dlist_s"],
                        "prep_init_xfer": prep["init_s"]}}


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
    if "descs" in samples[0]:
        out["descs"] = samples[0]["descs"]
    if "d_has_data" in samples[0]:
        out["d_has_data_ms"] = med([s["d_has_data"] for s in samples]) * 1e3
    return out


def run_case(pair: Pair, rng, bs: int, tokens: int, blocks: int, args) -> dict:
    nbytes = tokens * per_token_bytes(args)
    n = -(-tokens // bs)
    pblocks = fragmented_blocks(rng, blocks, n)
    dblocks = fragmented_blocks(rng, blocks, n)
    plan = plan_writes(pair.pgeo, pblocks, pair.dgeo, dblocks, first_token=0, num_tokens=tokens)
    seed = int(rng.integers(1 << 20))
    pair.P.call("fill", seed, tokens, pblocks, timeout=600)
    methods = [m for m in METHODS if m == "push" or pair.pull_ok]
    samples: dict[str, list] = {m: [] for m in methods}
    checks: dict[str, dict] = {m: {"transfers": 0, "mismatch": 0, "canary": 0,
                                   "checked_bytes": 0} for m in methods}
    errors: dict[str, str] = {}
    for r in range(args.reps + 1):  # repetition 0 is the warm-up (verified, not counted)
        k = r % len(methods)
        for m in methods[k:] + methods[:k]:
            if m in errors:
                continue
            pair.D.call("canary", timeout=600)
            try:
                s = getattr(pair, m)(pblocks, dblocks, tokens)
            except PeerError as e:
                errors[m] = str(e).strip().splitlines()[-1][:300]
                log(f"    !! {m} failed: {errors[m]}")
                continue
            v = pair.D.call("verify", seed, tokens, dblocks, 0, m == "pull", timeout=600)
            c = checks[m]
            c["transfers"] += 1
            for key in ("mismatch", "canary", "checked_bytes"):
                c[key] += v[key]
            if v["mismatch"] or v["canary"]:
                log(f"    !! {m}: {v['mismatch']} elements wrong, {v['canary']} canary elements "
                    f"overwritten on D")
            if r > 0:
                samples[m].append(s)
    # negative control: the same check against another request's pattern must fail
    neg = pair.D.call("verify", seed + 1, tokens, dblocks, timeout=600)["mismatch"]
    if neg == 0:
        log("    !! negative control: a wrong seed verified clean")
    res = {m: summarize(samples[m], nbytes) for m in methods if samples[m]}
    out = {"block_size": bs, "tokens": tokens, "bytes": nbytes, "blocks": n,
           "pool_blocks": blocks, "reps": args.reps, "checks": checks, "errors": errors,
           "negative_control_mismatch": neg,
           "verified": {m: (checks[m]["transfers"] > 0 and checks[m]["mismatch"] == 0
                            and checks[m]["canary"] == 0 and neg > 0) for m in methods},
           "regions": {"push": plan.num_regions, "unmerged_pieces": plan.unmerged,
                       "pull_descs": 2 * args.layers * n,
                       "merge_ratio": plan.unmerged / max(1, plan.num_regions),
                       "mean_region_kib": nbytes / max(1, plan.num_regions) / 1024},
           **res}
    if "push" in res and "bare_write" in res:
        out["push_over_bare"] = res["push"]["median_ms"] / res["bare_write"]["median_ms"]
        out["push_over_bare_min"] = res["push"]["min_ms"] / res["bare_write"]["min_ms"]
    if "push" in res and "pull" in res:
        out["pull_over_push"] = res["pull"]["median_ms"] / res["push"]["median_ms"]
        out["pull_over_push_min"] = res["pull"]["min_ms"] / res["push"]["min_ms"]
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--block-sizes", default="16,128")
    ap.add_argument("--layers", type=int, default=QWEN3_32B["num_layers"])
    ap.add_argument("--kv-heads", type=int, default=QWEN3_32B["num_kv_heads"])
    ap.add_argument("--head-size", type=int, default=QWEN3_32B["head_size"])
    ap.add_argument("--alloc", default="per_layer", choices=("per_layer", "pool"),
                    help="per_layer: one allocation per layer (as vLLM); pool: one allocation")
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions per method")
    ap.add_argument("--slack", type=float, default=1.125,
                    help="pool size / blocks of the largest case of a block size")
    ap.add_argument("--heartbeat-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--name", default="transfer_gpu", help="output file stem")
    args = ap.parse_args(argv)
    args.token_list = [int(t) for t in args.tokens.split(",")]
    args.bs_list = [int(b) for b in args.block_sizes.split(",")]
    return args


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in ("nixl", "nixl-cu13", "nixl-cu12", "torch", "msgspec", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    rng = np.random.default_rng(args.seed)
    t_start = time.monotonic()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    cases, failed, infos = [], [], {}
    copy_gbps = None
    total = len(args.bs_list) * len(args.token_list)
    log(f"bench_transfer_gpu: {total} cases on {args.device}, {args.reps} reps of "
        f"{', '.join(METHODS)}; {args.layers} layers x {args.kv_heads} KV heads x "
        f"{args.head_size} bf16 = {per_token_bytes(args) // 1024} KiB/token")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def write() -> dict:
        result = {
            "started": started, "seconds": time.monotonic() - t_start,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "versions": _versions(),
                        "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
                        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
                        "peers": infos,
                        "device_copy_gbps": copy_gbps},
            "args": {k: v for k, v in vars(args).items() if not k.endswith("_list")},
            "model": f"{args.layers} layers, {args.kv_heads} KV heads, head size "
                     f"{args.head_size}, bf16, TP1",
            "cases": cases, "failed": failed,
        }
        (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
        (out / f"{args.name}.md").write_text(markdown(result))
        return result

    done = 0
    for bs in args.bs_list:
        blocks = pool_blocks(max(args.token_list), bs, args.slack)
        gib = 2 * blocks * bs * per_token_bytes(args) / 2**30
        log(f"[bs{bs}] starting P and D, pools of {blocks} blocks ({gib:.1f} GiB together)...")
        t = time.monotonic()
        try:
            pair = Pair(args, bs, blocks)
        except PeerError as e:
            log(f"  could not start: {e}")
            failed.append({"block_size": bs, "error": str(e)})
            continue
        infos[f"bs{bs}"] = pair.info
        log(f"  ready in {time.monotonic() - t:.1f}s: {pair.info}")
        try:
            if copy_gbps is None:
                nb = max(args.token_list) * per_token_bytes(args)
                copy_gbps = pair.P.call("copy_rate", nb, timeout=300)
                log(f"  device copy_ of {nb / 2**30:.2f} GiB: {copy_gbps:.0f} GB/s")
            for tokens in args.token_list:
                done += 1
                t = time.monotonic()
                log(f"  [{done}/{total}] bs{bs} {tokens} tokens "
                    f"({tokens * per_token_bytes(args) / 2**20:.0f} MiB)...")
                try:
                    c = run_case(pair, rng, bs, tokens, blocks, args)
                except PeerError as e:
                    log(f"    FAILED: {str(e).strip().splitlines()[-1]}")
                    failed.append({"block_size": bs, "tokens": tokens, "error": str(e)})
                    continue
                cases.append(c)
                write()  # after every case: a run cut short still leaves its results
                parts = [f"{m} {c[m]['median_ms']:.2f} ms ({c[m]['gbps']:.1f} GB/s)"
                         for m in METHODS if m in c]
                log("    " + " | ".join(parts) + f" | regions {c['regions']['push']} "
                    f"(pieces {c['regions']['unmerged_pieces']}), pull descs "
                    f"{c['regions']['pull_descs']} | verified {c['verified']} "
                    f"({time.monotonic() - t:.0f}s)")
        finally:
            pair.close()
    result = write()
    log(f"\nwrote {out / (args.name + '.json')} and .md ({time.monotonic() - t_start:.0f}s)\n")
    log(markdown(result))
    ok = not failed and bool(cases) and all(all(c["verified"].values()) and not c["errors"]
                                            for c in cases)
    return 0 if ok else 1


def _ms(c: dict, m: str) -> str:
    if m not in c:
        return "failed" if m in c.get("errors", {}) else "-"
    return f"{c[m]['median_ms']:.2f} ({c[m]['gbps']:.1f})"


def markdown(r: dict) -> str:
    m = r["machine"]
    peers = next(iter(m["peers"].values()), {})
    L = ["# Push vs pull on one GPU: VRAM -> VRAM through NIXL UCX (cuda_ipc)\n"]
    L.append(f"Command: `{r['command']}`  ")
    L.append(f"Started {r['started']}, {r['seconds']:.0f} s. {peers.get('gpu', peers.get('device'))}"
             f", torch {peers.get('torch')} (CUDA {peers.get('cuda')}), "
             f"{', '.join(f'{k} {v}' for k, v in m['versions'].items())}; Python {m['python']}, "
             f"{m['cpus']} CPUs; UCX environment {m.get('ucx_env') or '(none set)'}. Two spawned "
             f"processes on the same "
             f"{'GPU' if peers.get('backend') == 'cuda' else 'host (debug run)'}, "
             f"each a real `PushWorker` over per-layer KV tensors "
             f"{peers.get('tensor_shape')} bf16 described by `describe_kv_caches(backend="
             f"{peers.get('backend')})`. Contiguous device `copy_` of the largest case in one "
             f"process: {m['device_copy_gbps'] or float('nan'):.0f} GB/s.  ")
    L.append(f"{r['model']}; P and D kv_split NHD, same block size, block ids fragmented (runs of "
             f"1-3) independently on P and D. One verified warm-up, then {r['args']['reps']} "
             f"interleaved repetitions (order rotating); every transfer, warm-up included, is "
             f"verified on D's GPU (each element of the target tokens against the pattern, every "
             f"other element of D's pool against a canary). Median ms (GB/s).\n")
    L.append("| case | MiB | push | pull | bare WRITE | push/bare | pull/push | push regions "
             "(pieces) | pull descs | KiB/region | verified |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for c in r["cases"]:
        rg = c["regions"]
        ver = "all" if all(c["verified"].values()) and not c["errors"] else \
            ", ".join(f"{k}: {'ok' if v else 'BAD'}" for k, v in c["verified"].items())
        nver = sum(ch["transfers"] for ch in c["checks"].values())
        L.append(f"| bs{c['block_size']} {c['tokens']} tok | {c['bytes'] / 2**20:.0f} | "
                 f"{_ms(c, 'push')} | {_ms(c, 'pull')} | {_ms(c, 'bare_write')} | "
                 f"{c.get('push_over_bare', float('nan')):.2f} | "
                 f"{c.get('pull_over_push', float('nan')):.2f} | {rg['push']} "
                 f"({rg['unmerged_pieces']}) | {rg['pull_descs']} | {rg['mean_region_kib']:.0f} | "
                 f"{ver} ({nver} transfers) |")
    for f in r["failed"]:
        L.append(f"| bs{f['block_size']} {f.get('tokens', 'all')} tok | FAILED: "
                 f"{f['error'].strip().splitlines()[-1][:150]} ||||||||| ")
    L.append("")
    if any("breakdown_ms" in c.get("pull", {}) for c in r["cases"]):
        L.append("Pull breakdown (medians, ms): relay = P's prefill-done to D's HTTP handler; "
                 "descs = per-block descriptor arrays; post = get_xfer_descs + initialize_xfer + "
                 "transfer(); read = to DONE on D; notif = D's DONE to P's notification.\n")
        L.append("| case | relay | descs | post | read | notif | D has data | total |")
        L.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for c in r["cases"]:
            if "pull" not in c:
                continue
            b = c["pull"]["breakdown_ms"]
            L.append(f"| bs{c['block_size']} {c['tokens']} | {b['relay_http']:.2f} | "
                     f"{b['desc_build']:.2f} | {b['post']:.2f} | {b['read_to_done']:.2f} | "
                     f"{b['done_to_p_notif']:.2f} | {c['pull']['d_has_data_ms']:.2f} | "
                     f"{c['pull']['median_ms']:.2f} |")
        L.append("")
    if any("bare_write" in c for c in r["cases"]):
        L.append("Bare WRITE (medians, ms): post = transfer(); wait = post to DONE; outside the "
                 "timed span: plan = plan_writes, dlists = get_xfer_descs x2, init = "
                 "initialize_xfer.\n")
        L.append("| case | descs | post | wait | plan | dlists | init |")
        L.append("|---|---:|---:|---:|---:|---:|---:|")
        for c in r["cases"]:
            if "bare_write" not in c:
                continue
            b = c["bare_write"]["breakdown_ms"]
            L.append(f"| bs{c['block_size']} {c['tokens']} | {c['bare_write']['descs']} | "
                     f"{b['post']:.2f} | {b['post_to_done']:.2f} | {b['prep_plan']:.2f} | "
                     f"{b['prep_dlists']:.2f} | {b['prep_init_xfer']:.2f} |")
        L.append("")
    L.append("Samples (ms, measured repetitions in run order):\n")
    for c in r["cases"]:
        L.append(f"- bs{c['block_size']} {c['tokens']}: " + "; ".join(
            f"{m} {c[m]['samples_ms']}" for m in METHODS if m in c))
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
