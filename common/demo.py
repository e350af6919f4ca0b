"""``kv-push-demo``: one producer (P) and one decoder (D) in two OS processes, real NIXL.

Each side is a ``PushWorker`` over a synthetic host pool (a ``LocalPeer`` child), the two talk
NIXL over UCX loopback exactly as two vLLM workers would: D handshakes with P's side channel,
registers its blocks as a notification, P WRITEs the prompt's KV into them and the ``WriteDone``
notice rides the WRITE. P and D use different layouts on purpose (default: P ``kv_split`` with
block size 16, D ``blocks_first`` with block size 32), so the mapping across layouts is exercised.

For every request P's blocks are filled with a reproducible pattern, the request is handed off
(half of the requests register on D before the prefill is done, half after), and D checks every
byte of its blocks against the pattern. The table gives, per request, the time from P's
``prefill_done`` call to D's ``received`` outcome, both stamped inside the child processes with
``time.monotonic`` (one clock for every process on Linux).

The peer processes, pools and pattern are test/demo harness in ``kv_push.common.testing``;
this module is only the command line.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import numpy as np

from .testing.block_ids import fragmented_blocks
from .testing.peer_process import LocalPeer, PeerError, PeerSpec, start_pair


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="kv-push-demo",
        description="Local 1P1D push demo: two processes, real NIXL (UCX loopback), KV bytes "
                    "verified on the decoder. Default geometry: Llama-3.1-8B (32 layers, 8 KV "
                    "heads, head size 128, bf16).")
    g = ap.add_argument_group("geometry")
    g.add_argument("--layers", type=int, default=32)
    g.add_argument("--kv-heads", type=int, default=8)
    g.add_argument("--head-size", type=int, default=128)
    g.add_argument("--dtype-bytes", type=int, default=2, help="2 = bf16")
    g.add_argument("--p-block-size", type=int, default=16)
    g.add_argument("--d-block-size", type=int, default=32)
    g.add_argument("--p-placement", default="kv_split",
                   choices=("kv_split", "blocks_first", "combined"))
    g.add_argument("--d-placement", default="blocks_first",
                   choices=("kv_split", "blocks_first", "combined"))
    g.add_argument("--p-order", default="NHD", choices=("NHD", "HND"))
    g.add_argument("--d-order", default="NHD", choices=("NHD", "HND"))
    r = ap.add_argument_group("requests")
    r.add_argument("--requests", type=int, default=8)
    r.add_argument("--min-tokens", type=int, default=1500)
    r.add_argument("--max-tokens", type=int, default=3500)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--pool-factor", type=float, default=2.0,
                   help="each pool holds this many times the largest request's blocks; blocks "
                        "are drawn fragmented from the whole pool")
    r.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.min_tokens < 1 or args.max_tokens < args.min_tokens:
        ap.error("need --requests >= 1 and 1 <= --min-tokens <= --max-tokens")
    if "combined" in (args.p_placement, args.d_placement) and args.p_placement != args.d_placement:
        ap.error("'combined' ([K|V] vectors) maps only onto 'combined'")
    return args


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def _spec(args, side: str) -> PeerSpec:
    bs = args.p_block_size if side == "p" else args.d_block_size
    placement = args.p_placement if side == "p" else args.d_placement
    head_size = args.head_size * (2 if placement == "combined" else 1)
    blocks = int(-(-args.max_tokens // bs) * args.pool_factor) + 1
    return PeerSpec(
        role="producer" if side == "p" else "decoder", placement=placement,
        num_layers=args.layers, num_kv_heads=args.kv_heads, head_size=head_size,
        dtype_bytes=args.dtype_bytes, block_size=bs, num_blocks=blocks,
        token_order=args.p_order if side == "p" else args.d_order,
        engine_id=f"demo-{'prefill' if side == 'p' else 'decode'}",
        config={"side_channel_port": 0} if side == "p" else {})


def _wait_counter(peer: LocalPeer, name: str, target: float, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if peer.call("counters").get(name, 0) >= target:
            return True
        time.sleep(0.001)
    return False


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    rng = np.random.default_rng(args.seed)
    p_spec, d_spec = _spec(args, "p"), _spec(args, "d")
    per_token = 2 * args.layers * args.kv_heads * args.head_size * args.dtype_bytes
    print("kv-push demo: 1 producer + 1 decoder, two processes, NIXL UCX loopback")
    print(f"  KV: {args.layers} layers x {args.kv_heads} KV heads x head size {args.head_size} x "
          f"{args.dtype_bytes} B = {_fmt_bytes(per_token)}/token")
    for name, sp in (("P", p_spec), ("D", d_spec)):
        print(f"  {name}: {sp.placement} {sp.token_order} block size {sp.block_size}, pool "
              f"{sp.num_blocks} blocks ({_fmt_bytes(per_token * sp.block_size * sp.num_blocks)})")
    t_start = time.monotonic()
    print("  starting both workers...", flush=True)
    try:
        P, D = start_pair(p_spec, d_spec)
    except PeerError as e:
        print(f"could not start the workers:\n{e}", file=sys.stderr)
        return 2
    failures = 0
    rows = []
    try:
        address = P.call("address")
        print(f"  started in {time.monotonic() - t_start:.1f}s; P side channel "
              f"{address[0]}:{address[1]}\n", flush=True)
        early_seen = 0
        for i in range(args.requests):
            tokens = int(rng.integers(args.min_tokens, args.max_tokens + 1))
            pblocks = fragmented_blocks(rng, p_spec.num_blocks, -(-tokens // p_spec.block_size))
            dblocks = fragmented_blocks(rng, d_spec.num_blocks, -(-tokens // d_spec.block_size))
            key, tid, seed = f"req-{i}", f"xfer-{i}-{rng.integers(1 << 30):08x}", 1000 + i
            P.call("fill_pattern", seed, tokens, pblocks)
            early = i % 2 == 0
            if early:  # D registers first; wait until P holds the registration
                D.call("expect_at", key, tid, 0, address, dblocks, 0, tokens)
                early_seen += 1
                if not _wait_counter(P, "registrations_early", early_seen, args.timeout):
                    raise PeerError(f"{key}: P never got the registration")
                t0 = P.call("prefill_done_at", key, tid, pblocks, tokens)
            else:  # prefill finishes first, D registers right after
                t0 = P.call("prefill_done_at", key, tid, pblocks, tokens)
                D.call("expect_at", key, tid, 0, address, dblocks, 0, tokens)
            got = D.call("outcome_at", key, args.timeout)
            released = P.call("wait_released", [key], args.timeout)
            if got is None:
                kind, reason, secs = "timeout", f"no outcome in {args.timeout}s", float("nan")
            else:
                kind, reason, t1 = got
                secs = t1 - t0
            bad = D.call("verify_pattern", seed, tokens, dblocks) if kind == "received" else -1
            ok = kind == "received" and bad == 0 and released == [key]
            failures += not ok
            nbytes = tokens * per_token
            rows.append((i, "before" if early else "after", tokens, len(pblocks), len(dblocks),
                         nbytes, secs, kind, bad, bool(released), ok, reason))
            _print_row(rows[-1], header=i == 0)
        _print_totals(rows)
        _print_counters(P.call("counters"), D.call("counters"))
    except PeerError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        failures += 1
    finally:
        for peer in (P, D):
            try:
                peer.call("quiet", timeout=5)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        P.close()
        D.close()
    print(f"\n{'ALL VERIFIED' if failures == 0 else f'{failures} FAILED'} "
          f"({time.monotonic() - t_start:.1f}s in all)")
    return 0 if failures == 0 else 1


_HEADER = (f"{'req':>3}  {'D registered':>14}  {'tokens':>6}  {'P blk':>5}  {'D blk':>5}  "
           f"{'bytes':>10}  {'prefill-done->received':>22}  {'GB/s':>6}  {'P freed':>7}  verified")


def _print_row(row, header: bool) -> None:
    i, when, tokens, npb, ndb, nbytes, secs, kind, bad, freed, ok, reason = row
    if header:
        print(_HEADER)
        print("-" * len(_HEADER))
    rate = nbytes / secs / 1e9 if secs == secs and secs > 0 else float("nan")
    if kind != "received":
        verdict = f"FAILED: {kind} {reason}"
    elif bad:
        verdict = f"FAILED: {bad} bytes differ"
    elif not freed:
        verdict = "FAILED: P never freed its blocks"
    else:
        verdict = "OK"
    print(f"{i:>3}  {when + ' prefill':>14}  {tokens:>6}  {npb:>5}  {ndb:>5}  "
          f"{_fmt_bytes(nbytes):>10}  {secs * 1e3:>19.1f} ms  {rate:>6.2f}  "
          f"{'yes' if freed else 'no':>7}  {verdict}", flush=True)


def _print_totals(rows) -> None:
    done = [r for r in rows if r[7] == "received"]
    total_bytes = sum(r[5] for r in done)
    total_s = sum(r[6] for r in done)
    print("-" * len(_HEADER))
    if done:
        times = sorted(r[6] for r in done)
        print(f"total: {len(done)}/{len(rows)} received, {sum(r[2] for r in done)} tokens, "
              f"{_fmt_bytes(total_bytes)} in {total_s * 1e3:.0f} ms of hand-off time "
              f"({total_bytes / total_s / 1e9:.2f} GB/s); "
              f"median {times[len(times) // 2] * 1e3:.1f} ms")
    for when in ("before", "after"):
        sel = [r for r in done if r[1] == when]
        if sel:
            b, s = sum(r[5] for r in sel), sum(r[6] for r in sel)
            print(f"  registered {when} prefill-done: {len(sel)} requests, {b / s / 1e9:.2f} GB/s")
    print("(time: P's prefill_done call -> D's 'received' outcome, stamped inside the two "
          "processes on one\n monotonic clock; 'after prefill' rows include D's registration "
          "reaching P)")


def _print_counters(p: dict, d: dict) -> None:
    names = sorted(set(p) | set(d))
    print(f"\n{'counter':<32} {'producer':>14} {'decoder':>14}")
    for n in names:
        def fmt(v):
            if v is None:
                return "-"
            if n.endswith("seconds") or (isinstance(v, float) and not float(v).is_integer()):
                return f"{v:.4f}"
            return f"{int(v)}"
        print(f"{n:<32} {fmt(p.get(n)):>14} {fmt(d.get(n)):>14}")


if __name__ == "__main__":
    sys.exit(main())
