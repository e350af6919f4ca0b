"""``kv-push-demo``: one producer (P) and one decoder (D) in two OS processes, real NIXL.

Each side is a ``PushWorker`` over a synthetic host pool (``LocalPeer``), the two talk NIXL over
UCX loopback exactly as two vLLM workers would: D handshakes with P's side channel, registers
its blocks as a notification, P WRITEs the prompt's KV into them and the ``WriteDone`` notice
rides the WRITE. P and D use different layouts on purpose (default: P ``kv_split`` with block
size 16, D ``blocks_first`` with block size 32), so the mapping across layouts is exercised.

For every request P's blocks are filled with a reproducible pattern, the request is handed off
(half of the requests register on D before the prefill is done, half after), and D checks every
byte of its blocks against the pattern. The table gives, per request, the time from P's
``prefill_done`` call to D's ``received`` outcome, both stamped inside the child processes with
``time.monotonic`` (one clock for every process on Linux).

This module also holds two pieces the benchmarks reuse:

* a fast pattern fill/verify (``fill_pattern`` / ``verify_pattern``): a random table read at a
  seed- and position-dependent offset, so any misplaced, missing or stale byte is caught, at
  memcpy speed (``PeerServer.fill``/``verify`` draw a fresh random tensor per request, which is
  exact but several seconds per GiB here);
* ``ServerPeer``: a ``LocalPeer`` whose child runs a ``PeerServer`` subclass named by
  ``"module:Class"``, for commands ``PeerServer`` does not have.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from .local_peer import LocalPeer, PeerError, PeerServer, PeerSpec
from .synthetic_kv import HostPool, fragmented_blocks

# -- pattern KV --------------------------------------------------------------------------------

_PATTERN_PERIOD = (16 << 20) + 4093  # odd: consecutive blocks never see the same bytes
_PATTERN_TAIL = 8 << 20  # longest contiguous run read without wrapping (one block part)
_pattern: np.ndarray | None = None


def _table() -> np.ndarray:
    global _pattern
    if _pattern is None:
        r = np.random.default_rng(0x6B76).integers(0, 256, _PATTERN_PERIOD, dtype=np.uint8)
        _pattern = np.concatenate((r, r[:_PATTERN_TAIL]))
    return _pattern


def _runs(pool: HostPool, seed: int, block_ids: Sequence[int], num_tokens: int, first_token: int):
    """Yield (pool view, expected bytes) for every (block, layer, K/V) piece of the request.

    The logical KV of request ``seed`` is ``L[layer, part, token, head, byte]``; its row for
    (layer, part, token) -- all heads -- starts at a seed-dependent offset in the pattern table.
    """
    g = pool.geometry
    row = g.num_kv_heads * g.vec_bytes
    lo, hi = g.head_range
    table = _table()
    if g.block_size * row > _PATTERN_TAIL:
        raise ValueError(f"block of {g.block_size * row} bytes exceeds the pattern tail")
    bases = [[(seed * 0x9E3779B1 + (layer * g.kv_parts + part) * 0x51ED27) % _PATTERN_PERIOD
              for part in range(g.kv_parts)] for layer in range(g.num_layers)]
    for j, b in enumerate(block_ids):
        t0 = first_token + j * g.block_size
        if t0 >= num_tokens:
            break
        n = min(g.block_size, num_tokens - t0)
        for layer in range(g.num_layers):
            for part in range(g.kv_parts):
                off = (bases[layer][part] + t0 * row) % _PATTERN_PERIOD
                want = table[off: off + n * row].reshape(n, g.num_kv_heads, g.vec_bytes)
                yield pool._block(layer, part, b)[:n], want[:, lo:hi]


def fill_pattern(pool: HostPool, seed: int, block_ids: Sequence[int], num_tokens: int,
                 first_token: int = 0) -> None:
    """Write tokens ``[first_token, num_tokens)`` of request ``seed`` into ``block_ids``."""
    for view, want in _runs(pool, seed, block_ids, num_tokens, first_token):
        view[...] = want


def verify_pattern(pool: HostPool, seed: int, block_ids: Sequence[int], num_tokens: int,
                   first_token: int = 0) -> int:
    """Number of bytes of tokens ``[first_token, num_tokens)`` in ``block_ids`` that are wrong."""
    bad = 0
    for view, want in _runs(pool, seed, block_ids, num_tokens, first_token):
        if not np.array_equal(view, want):
            bad += int(np.count_nonzero(view != want))
    return bad


# -- a peer server with timestamps -------------------------------------------------------------


class DemoPeerServer(PeerServer):
    """``PeerServer`` plus pattern fill/verify and monotonic timestamps of hand-offs/outcomes."""

    def __init__(self, spec: PeerSpec):
        super().__init__(spec)
        self._cond = threading.Condition()
        self._stamped: dict[str, tuple[str, str, float]] = {}
        self._stop = threading.Event()
        self._collector = None
        if self.worker.decoder is not None:
            self._collector = threading.Thread(target=self._collect, name="outcome-collector",
                                               daemon=True)
            self._collector.start()

    def _collect(self) -> None:
        """Take outcomes the moment the transfer thread emits them, and stamp them."""
        q = self.worker.decoder.outcomes
        while not self._stop.is_set():
            try:
                o = q.get(timeout=0.2)
            except queue.Empty:
                continue
            now = time.monotonic()
            with self._cond:
                self._stamped[o.key] = (o.kind, o.reason, now)
                self._cond.notify_all()

    def fill_pattern(self, seed: int, num_tokens: int, block_ids, first_token: int = 0) -> None:
        fill_pattern(self.pool, seed, block_ids, num_tokens, first_token)

    def verify_pattern(self, seed: int, num_tokens: int, block_ids, first_token: int = 0) -> int:
        return verify_pattern(self.pool, seed, block_ids, num_tokens, first_token)

    def zero_blocks(self, block_ids) -> None:
        g = self.pool.geometry
        for b in block_ids:
            for layer in range(g.num_layers):
                for part in range(g.kv_parts):
                    self.pool._block(layer, part, b)[...] = 0

    def prefill_done_at(self, key, transfer_id, block_ids, num_tokens) -> float:
        """Hand a finished prefill to the worker; returns the monotonic time of the call."""
        ids = list(block_ids)
        t0 = time.monotonic()
        self.worker.prefill_done(key, transfer_id, ids, num_tokens)
        return t0

    def expect_at(self, key, transfer_id, attempt, address, block_ids, first_token,
                  num_tokens) -> float:
        t0 = time.monotonic()
        self.worker.expect(key, transfer_id, attempt, tuple(address), block_ids, first_token,
                           num_tokens)
        return t0

    def outcome_at(self, key: str, timeout: float):
        """(kind, reason, monotonic time the outcome was emitted) or None on time-out."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._stamped:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._stamped.pop(key)

    def wait_outcome(self, key: str, timeout: float):
        t0 = time.monotonic()
        got = self.outcome_at(key, timeout)
        if got is None:
            return None
        return got[0], got[1], time.monotonic() - t0

    def clock(self) -> float:
        return time.monotonic()

    def quiet(self) -> None:
        """Before a planned shutdown: the peer's goodbye is expected, not worth a warning."""
        logging.getLogger("kv_push.common.transfer_thread").setLevel(logging.ERROR)

    def close(self):
        self._stop.set()
        return super().close()


class ServerPeer(LocalPeer):
    """A ``LocalPeer`` whose child runs the ``PeerServer`` subclass named by ``server``."""

    def __init__(self, spec: PeerSpec, server: str = f"{__name__}:DemoPeerServer",
                 start_timeout: float = 120.0):
        super().__init__(spec, start_timeout, server=server)


def start_pair(p_spec: PeerSpec, d_spec: PeerSpec, server: str = f"{__name__}:DemoPeerServer"
               ) -> tuple[ServerPeer, ServerPeer]:
    """Start P and D at the same time (each child allocates and touches its pool)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with ThreadPoolExecutor(2) as ex:
        fp = ex.submit(ServerPeer, p_spec, server)
        fd = ex.submit(ServerPeer, d_spec, server)
        errors = []
        peers = []
        for f in (fp, fd):
            try:
                peers.append(f.result())
            except Exception as e:  # close the one that started
                errors.append(e)
        if errors:
            for p in peers:
                p.close()
            raise errors[0]
    return peers[0], peers[1]


# -- the demo ----------------------------------------------------------------------------------


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
