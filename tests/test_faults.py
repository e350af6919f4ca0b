"""Fault tolerance through real NIXL agents in separate OS processes.

Each test is a real-process scenario: aborts (one, then a storm with block reuse), kill -9 of a
decoder and of a producer, a hung and a refused handshake, WRITEs that cannot be planned or posted,
stale and hostile control messages, and the authenticated control plane. Figures (faults
injected, outcomes, times to detect) go into the session's ``figures`` table, printed at the end.

All peers here use ``heartbeat_interval_s = 2`` (a peer silent for 3 s is unresponsive: long
enough that a healthy peer on a loaded 2-core box is not taken for silent) and decoders
``handshake_timeout_s = 3``. A killed process is usually seen at once (its side-channel lifeline
closes, or UCX reports the endpoint gone); a frozen one (SIGSTOP) only through the heartbeat,
which marks it unresponsive but is not taken for proof of death
(``test_frozen_decoder_keeps_the_source_until_its_write_ends``).

Nothing here asserts a duration (a loaded CI box stretches every one): each fault is checked for
the property that matters -- the outcome and its reason (a dead peer, not a time-out), ordering
(a healthy transfer finishes while a hung handshake is still pending; a frozen peer's source is
held until it dies), and "long before the time-out that would otherwise end it" (the generous
waits below are far under the rendezvous and transfer time-outs) -- and the measured times go
into the figures table printed at the end of the run.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import socket
import threading
import time

import msgspec
import numpy as np
import pytest

from kv_push.common.messages import (
    PROTOCOL_VERSION,
    Codec,
    Envelope,
    Heartbeat,
    MessageRejected,
    Register,
)
from kv_push.common.testing.block_ids import fragmented_blocks
from kv_push.common.testing.peer_process import PeerSpec

try:
    from conftest import (assert_no_leaks, close_peers, counter, free_port, live_state,
                          start_peers, wait_counter)
except ModuleNotFoundError:  # imported as a package module
    from tests.conftest import (assert_no_leaks, close_peers, counter, free_port, live_state,
                                start_peers, wait_counter)

pytestmark = pytest.mark.nixl

HB = 2.0
HANDSHAKE_TIMEOUT = 3.0
#: how long a fault may take to be handled before the test calls it broken: far under the
#: rendezvous time-out (120 s) and the transfer time-out (60 s) that would otherwise end it
WAIT = 30.0
SECRET = "s3cret-shared"
CANARY = 0xA5
COMMON = {"heartbeat_interval_s": HB, "handshake_timeout_s": HANDSHAKE_TIMEOUT}
_ids = itertools.count()


def uid(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


def _p(secret: str = "", **config):
    return PeerSpec(role="producer", config={"side_channel_port": 0, **COMMON, **config},
                    secret=secret)


def _d(secret: str = "", **config):
    # blocks_first HND 8-token blocks against the producers' kv_split NHD 16: WRITEs of many
    # small regions, so they stay in flight a little while
    return PeerSpec(role="decoder", placement="blocks_first", token_order="HND", block_size=8,
                    num_blocks=512, config={**COMMON, **config}, secret=secret)


class FaultPeers:
    def __init__(self):
        specs = {
            "P": _p(),             # the healthy producer
            "D": _d(),             # the healthy decoder
            "Dv": _d(),            # decoder killed by test_kill_decoder...
            "Df": _d(),            # decoder frozen (SIGSTOP) by test_frozen_decoder...
            "Pv": _p(),            # producer killed by test_kill_producer...
            "R": _d(secret="not-the-secret"),  # rogue agent / decoder with the wrong secret
            "Ps": _p(secret=SECRET),            # producer that requires the secret
            "Ds": _d(secret=SECRET),            # decoder that has it
        }
        self.by_name = dict(zip(specs, start_peers(*specs.values())))
        for name, peer in self.by_name.items():
            setattr(self, name, peer)

    def alive(self, *names):
        return [self.by_name[n] for n in names if self.by_name[n].process.is_alive()]

    def close(self):
        close_peers(*self.alive(*self.by_name))


@pytest.fixture(scope="module")
def fp():
    p = FaultPeers()
    yield p
    p.close()


@pytest.fixture(autouse=True)
def no_leaks(fp):
    producers, decoders = ("P", "Pv", "Ps"), ("D", "Dv", "Df", "R", "Ds")
    before = live_state(fp.alive(*producers), fp.alive(*decoders))
    yield
    assert_no_leaks(fp.alive(*producers), fp.alive(*decoders), baseline=before)


def nblocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def push_ok(P, D, num_tokens: int = 40, seed: int | None = None) -> float:
    """One healthy transfer P -> D, verified; returns the latency expect -> received."""
    seed = random.randrange(1 << 30) if seed is None else seed
    tid, pkey, dkey = uid("t"), uid("p"), uid("d")
    pb = list(range(200, 200 + nblocks(num_tokens, 16)))
    db = list(range(400, 400 + nblocks(num_tokens, 8)))
    P.call("fill", seed, num_tokens, pb)
    t0 = time.monotonic()
    D.call("expect", dkey, tid, 0, P.call("address"), db, 0, num_tokens)
    P.call("prefill_done", pkey, tid, pb, num_tokens)
    out = D.call("wait_outcome", dkey, 10)
    latency = time.monotonic() - t0
    assert out is not None and out[0] == "received", out
    assert D.call("verify", seed, num_tokens, db, 0) == 0
    assert P.call("wait_released", [pkey], 5) == [pkey]
    return latency


# -- aborts ------------------------------------------------------------------------------------


def test_abort_after_registration_is_never_written(fp, figures):
    P, D = fp.P, fp.D
    n, seed = 45, 77
    tid, pkey, dkey = uid("t"), uid("p"), uid("d")
    pb, db = [3, 4, 5], [10, 11, 12, 13, 14, 15]
    P.call("fill", seed, n, pb)
    D.call("fill_blocks", db, CANARY)
    early, cancels = counter(P, "registrations_early"), counter(P, "cancels")
    D.call("expect", dkey, tid, 0, P.call("address"), db, 0, n)
    assert wait_counter(P, "registrations_early", early + 1) == early + 1
    t0 = time.monotonic()
    D.call("cancel", dkey)
    kind, reason, _ = D.call("wait_outcome", dkey, 5)
    released_after = time.monotonic() - t0
    assert kind == "released", reason
    assert wait_counter(P, "cancels", cancels + 1) == cancels + 1
    # the prefill finishes only now: P must not write, and must release its blocks
    P.call("prefill_done", pkey, tid, pb, n)
    assert P.call("wait_released", [pkey], 5) == [pkey]
    assert D.call("block_bytes_equal", db, CANARY), "P wrote into blocks D had cancelled"
    assert D.call("wait_outcome", dkey, 0.2) is None
    figures("faults", "abort after registration: cancel -> 'released' on D", released_after,
            "P acked, never wrote, released its source")


def test_abort_storm(fp, figures):
    """50 requests, a random half cancelled at random moments (before or after the prefill is
    done). A cancelled request's blocks are refilled with a fresh canary (reused) the moment D
    has reported its one outcome; at the end no canary may be corrupted and every request that
    was not cancelled must verify."""
    P, D = fp.P, fp.D
    push_ok(P, D)  # steady state: D already knows P, so every expect registers at once
    rng = random.Random(1234)
    nrng = np.random.default_rng(1234)
    count = 50
    sizes = [rng.randint(1, 60) for _ in range(count)]
    pall = fragmented_blocks(nrng, 256, sum(nblocks(n, 16) for n in sizes))
    dall = fragmented_blocks(nrng, 512, sum(nblocks(n, 8) for n in sizes))
    addr = P.call("address")
    reqs = []
    pi = di = 0
    for i, n in enumerate(sizes):
        pb, db = pall[pi: pi + nblocks(n, 16)], dall[di: di + nblocks(n, 8)]
        pi, di = pi + len(pb), di + len(db)
        P.call("fill", 5000 + i, n, pb)
        reqs.append(dict(tid=uid("t"), pkey=uid("p"), dkey=uid("d"), n=n, pb=pb, db=db,
                         seed=5000 + i, canary=1 + (i * 7) % 250, history=[]))
    D.call("fill_blocks", dall, CANARY)
    by_key = {r["dkey"]: r for r in reqs}

    ops = [("expect", i) for i in range(count)] + [("prefill", i) for i in range(count)]
    rng.shuffle(ops)
    cancelled = set(rng.sample(range(count), count // 2))
    for i in sorted(cancelled):
        pos = ops.index(("expect", i))
        ops.insert(rng.randint(pos + 1, len(ops)), ("cancel", i))
    before_prefill = sum(ops.index(("cancel", i)) < ops.index(("prefill", i)) for i in cancelled)

    refills = 0

    def maybe_refill(r):
        """The engine frees a cancelled request's blocks once D reported its one outcome
        ('released', or 'received' if the KV had already arrived) and at once reuses them."""
        nonlocal refills
        if r.get("cancel_issued") and r["history"] and not r.get("refilled"):
            D.call("fill_blocks", r["db"], r["canary"])
            r["refilled"] = True
            refills += 1

    def absorb():
        for key, kind, _reason in D.call("poll_outcomes"):
            r = by_key[key]
            r["history"].append(kind)
            maybe_refill(r)

    t0 = time.monotonic()
    for op, i in ops:
        r = reqs[i]
        if op == "expect":
            D.call("expect", r["dkey"], r["tid"], 0, addr, r["db"], 0, r["n"])
        elif op == "prefill":
            P.call("prefill_done", r["pkey"], r["tid"], r["pb"], r["n"])
        else:
            D.call("cancel", r["dkey"])
            r["cancel_issued"] = True
            maybe_refill(r)
        absorb()

    deadline = time.monotonic() + 20
    while not all(r["history"] for r in reqs) and time.monotonic() < deadline:
        absorb()
        time.sleep(0.005)
    elapsed = time.monotonic() - t0
    assert all(r["history"] for r in reqs), {
        i: ("cancelled" if i in cancelled else "kept", ops.index(("expect", i)),
            ops.index(("prefill", i)), ops.index(("cancel", i)) if i in cancelled else None)
        for i, r in enumerate(reqs) if not r["history"]}
    time.sleep(0.1)
    absorb()  # exactly one outcome per request: nothing more may come
    assert all(len(r["history"]) == 1 for r in reqs), [r["history"] for r in reqs]
    pkeys = sorted(r["pkey"] for r in reqs)
    assert sorted(P.call("wait_released", pkeys, 10)) == pkeys
    assert_no_leaks([P], [D])  # no job left on P: nothing can land any more

    received_before_cancel = sum(reqs[i]["history"] == ["received"] for i in cancelled)
    assert all(reqs[i]["history"] in (["received"], ["released"]) for i in cancelled)
    assert refills == len(cancelled)
    corrupted = [i for i in cancelled
                 if not D.call("block_bytes_equal", reqs[i]["db"], reqs[i]["canary"])]
    completed = [i for i in range(count) if i not in cancelled]
    outcomes_ok = [i for i in completed if reqs[i]["history"] == ["received"]]
    bad_bytes = {i: D.call("verify", reqs[i]["seed"], reqs[i]["n"], reqs[i]["db"], 0)
                 for i in completed}
    figures("faults", "abort storm: requests / cancelled (before, after prefill)",
            f"{count} / {len(cancelled)} ({before_prefill}, {len(cancelled) - before_prefill})",
            f"{received_before_cancel} had already received their KV when cancelled")
    figures("faults", "abort storm: reused blocks refilled / corrupted canaries",
            f"{refills} / {len(corrupted)}")
    figures("faults", "abort storm: completed requests verified",
            f"{sum(v == 0 for v in bad_bytes.values())}/{len(completed)}", f"in {elapsed:.2f} s")
    assert not corrupted, f"P wrote into released blocks of requests {corrupted}"
    assert outcomes_ok == completed, {i: reqs[i]["history"] for i in completed}
    assert not any(bad_bytes.values()), bad_bytes


# -- peer death --------------------------------------------------------------------------------


def test_kill_decoder_after_registration(fp, figures):
    """kill -9 of D with one WRITE in flight (D frozen first, so it cannot complete) and one
    registration still waiting for its prefill: P releases both sources and drops D in bounded
    time, and holds nothing afterwards."""
    P, Dv = fp.P, fp.Dv
    addr = P.call("address")
    peers_before = P.call("live")["peers"]
    early = counter(P, "registrations_early")
    a = dict(tid=uid("t"), pkey=uid("p"), dkey=uid("d"), pb=[20, 21, 22], db=[30, 31, 32, 33, 34])
    b = dict(tid=uid("t"), pkey=uid("p"), dkey=uid("d"), pb=[23, 24], db=[40, 41, 42, 43])
    P.call("fill", 1, 40, a["pb"])
    P.call("fill", 2, 30, b["pb"])
    Dv.call("expect", a["dkey"], a["tid"], 0, addr, a["db"], 0, 40)
    Dv.call("expect", b["dkey"], b["tid"], 0, addr, b["db"], 0, 30)
    assert wait_counter(P, "registrations_early", early + 2) == early + 2
    assert P.call("live")["peers"] == peers_before + 1

    os.kill(Dv.process.pid, signal.SIGSTOP)  # frozen: heartbeats and NIXL progress stop
    t_stop = time.monotonic()
    P.call("prefill_done", a["pkey"], a["tid"], a["pb"], 40)
    in_flight = P.call("live")["jobs"]
    Dv.kill()
    t_kill = time.monotonic()
    assert P.call("wait_released", [a["pkey"]], WAIT) == [a["pkey"]]
    t_release = time.monotonic() - t_kill
    while P.call("live")["peers"] > peers_before and time.monotonic() - t_kill < WAIT:
        time.sleep(0.005)
    t_drop = time.monotonic() - t_kill
    assert P.call("live")["peers"] == peers_before, "P still tracks the dead decoder"
    # the registration D left behind went with it: the prefill is released at once
    t0 = time.monotonic()
    P.call("prefill_done", b["pkey"], b["tid"], b["pb"], 30)
    assert P.call("wait_released", [b["pkey"]], WAIT) == [b["pkey"]]
    t_late = time.monotonic() - t0
    assert_no_leaks([P], [])

    figures("faults", "kill -9 D (WRITE in flight): kill -> source released", t_release,
            f"{in_flight} WRITE in flight at the kill")
    figures("faults", "kill -9 D: kill -> P drops D", t_drop,
            f"{t_drop + t_kill - t_stop:.3f} s after D went silent; "
            f"heartbeat time-out {1.5 * HB:.1f} s")
    figures("faults", "kill -9 D: later prefill for its registration released", t_late)
    assert counter(P, "peers_dead") >= 1


def test_frozen_decoder_keeps_the_source_until_its_write_ends(fp, figures):
    """D stops (SIGSTOP: no heartbeats, no NIXL progress, but no connection error either) with a
    WRITE in flight. Silence is not proof of death (issue 9 item 5): P marks D unresponsive,
    fails what D registered and posts nothing more to it, but keeps the source while the WRITE
    may still read it. Only D's death (its lifeline closes) lets the source go."""
    P, Df = fp.P, fp.Df
    addr = P.call("address")
    peers_before = P.call("live")["peers"]
    early = counter(P, "registrations_early")
    silent = counter(P, "peers_silent")
    a = dict(tid=uid("t"), pkey=uid("p"), dkey=uid("d"), pb=[25, 26, 27], db=[36, 37, 38, 39, 44])
    b = dict(tid=uid("t"), pkey=uid("p"), dkey=uid("d"), pb=[28, 29], db=[45, 46, 47, 48])
    P.call("fill", 4, 40, a["pb"])
    Df.call("expect", a["dkey"], a["tid"], 0, addr, a["db"], 0, 40)
    Df.call("expect", b["dkey"], b["tid"], 0, addr, b["db"], 0, 30)
    assert wait_counter(P, "registrations_early", early + 2) == early + 2
    try:
        os.kill(Df.process.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        P.call("prefill_done", a["pkey"], a["tid"], a["pb"], 40)
        in_flight = P.call("live")["jobs"]
        assert wait_counter(P, "peers_silent", silent + 1) == silent + 1
        t_silent = time.monotonic() - t_stop
        # b's registration was failed: its prefill goes at once
        P.call("prefill_done", b["pkey"], b["tid"], b["pb"], 30)
        assert P.call("wait_released", [b["pkey"]], WAIT) == [b["pkey"]]
        if P.call("live")["jobs"]:  # the WRITE is still in flight (UCX needs D to progress)
            # ordering: watched for as long again as silence took to be noticed, never released
            assert P.call("wait_released", [a["pkey"]], 1.5 * HB) == [], \
                "P released a source its WRITE to a live (frozen) decoder may still read"
            held = True
        else:
            held = False
        assert P.call("live")["peers"] == peers_before + 1  # unresponsive, not dropped
    finally:
        Df.kill()
    t_kill = time.monotonic()
    assert P.call("wait_released", [a["pkey"]], WAIT) == [a["pkey"]]
    t_release = time.monotonic() - t_kill
    while P.call("live")["peers"] > peers_before and time.monotonic() - t_kill < WAIT:
        time.sleep(0.005)
    assert P.call("live")["peers"] == peers_before, "P still tracks the dead decoder"
    assert_no_leaks([P], [])
    figures("faults", "frozen D (SIGSTOP): stop -> P finds D unresponsive", t_silent,
            f"heartbeat only; time-out {1.5 * HB:.1f} s after D's last message")
    figures("faults", "frozen D, WRITE in flight: source held while frozen", held,
            f"{in_flight} WRITE in flight")
    figures("faults", "  then kill -9 D -> source released", t_release)


def test_kill_producer_after_registration(fp, figures):
    """kill -9 of P after D registered, before its prefill is done: D fails the request in
    bounded time, never reports it received, and keeps serving another producer."""
    Pv, D, P = fp.Pv, fp.D, fp.P
    n = 40
    tid, dkey = uid("t"), uid("d")
    db = [50, 51, 52, 53, 54]
    D.call("fill_blocks", db, CANARY)
    d_peers = D.call("live")["peers"]
    early = counter(Pv, "registrations_early")
    Pv.call("fill", 3, n, [1, 2, 3])
    D.call("expect", dkey, tid, 0, Pv.call("address"), db, 0, n)
    assert wait_counter(Pv, "registrations_early", early + 1) == early + 1
    assert D.call("live")["peers"] == d_peers + 1
    Pv.kill()
    t_kill = time.monotonic()
    out = D.call("wait_outcome", dkey, WAIT)
    t_fail = time.monotonic() - t_kill
    assert out is not None and out[0] == "failed", out
    assert "dead" in out[1], out  # seen dead, not timed out
    assert D.call("block_bytes_equal", db, CANARY)
    assert D.call("live")["peers"] == d_peers
    latency = push_ok(P, D)  # D still serves the other producer
    figures("faults", "kill -9 P after registration: kill -> 'failed' on D", t_fail,
            f"reason: {out[1][:60]}")
    figures("faults", "  then a request to another producer", latency, "received, verified")


# -- handshakes --------------------------------------------------------------------------------


class HungListener:
    """A 'producer' side channel that accepts connections and never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.address = self.sock.getsockname()[:2]
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            self.conns.append(conn)  # read nothing, answer nothing

    def close(self):
        self._stop.set()
        self._thread.join(2)
        for c in self.conns:
            c.close()
        self.sock.close()


def test_hung_handshake_does_not_delay_others(fp, figures):
    P, D = fp.P, fp.D
    push_ok(P, D)  # warm: D knows P
    baseline = sorted(push_ok(P, D) for _ in range(3))[1]
    hung = HungListener()
    try:
        hkey = uid("d")
        t_h = time.monotonic()
        D.call("expect", hkey, uid("t"), 0, hung.address, [60, 61], 0, 10)
        healthy = push_ok(P, D)  # while D's handshake with the hung peer is pending
        # ordering: the healthy transfer did not wait for the hung handshake to time out
        assert D.call("wait_outcome", hkey, 0) is None, "the hung handshake ended too early"
        out = D.call("wait_outcome", hkey, WAIT)
        t_fail = time.monotonic() - t_h
        assert len(hung.conns) >= 1
    finally:
        hung.close()
    assert out is not None and out[0] == "failed", out
    assert "handshake" in out[1] and "timed out" in out[1], out
    figures("faults", "healthy request latency, no hung peer (median of 3)", baseline)
    figures("faults", "healthy request latency, hung handshake pending", healthy)
    figures("faults", "hung handshake -> 'failed'", t_fail,
            f"handshake_timeout_s = {HANDSHAKE_TIMEOUT}")
    assert t_fail >= HANDSHAKE_TIMEOUT * 0.9, t_fail  # not before its time-out


def test_closed_port_fails_fast(fp, figures):
    D = fp.D
    port = free_port()  # nobody listens there
    key = uid("d")
    t0 = time.monotonic()
    D.call("expect", key, uid("t"), 0, ("127.0.0.1", port), [62, 63], 0, 10)
    out = D.call("wait_outcome", key, WAIT)
    elapsed = time.monotonic() - t0
    assert out is not None and out[0] == "failed", out
    # reported as refused, not after the handshake time-out
    assert "refused" in out[1].lower() and "timed out" not in out[1], out
    figures("faults", "closed port (connection refused) -> 'failed'", elapsed)


# -- WRITEs that cannot be planned or posted ----------------------------------------------------


@pytest.mark.parametrize("case", ["more_tokens_than_prefill", "block_id_out_of_range",
                                  "too_few_blocks"])
def test_unpostable_write_is_reported_at_once(fp, figures, case):
    P, D = fp.P, fp.D
    addr = P.call("address")
    tid, pkey, dkey = uid("t"), uid("p"), uid("d")
    p_tokens, pb = 40, [70, 71, 72]
    if case == "more_tokens_than_prefill":
        d_tokens, db, expect_in = 80, list(range(70, 80)), "prefill has"
    elif case == "block_id_out_of_range":
        d_tokens, db, expect_in = 40, [80, 81, 100_000, 83, 84], "outside"
    else:
        d_tokens, db, expect_in = 40, [85, 86], "need"
    P.call("fill", 9, p_tokens, pb)
    D.call("fill_blocks", [b for b in db if b < 512], CANARY)
    early = counter(P, "registrations_early")
    D.call("expect", dkey, tid, 0, addr, db, 0, d_tokens)
    assert wait_counter(P, "registrations_early", early + 1) == early + 1
    t0 = time.monotonic()
    P.call("prefill_done", pkey, tid, pb, p_tokens)
    out = D.call("wait_outcome", dkey, WAIT)
    elapsed = time.monotonic() - t0
    assert out is not None and out[0] == "failed", out
    assert expect_in in out[1], out  # P's own report, not D's transfer time-out
    assert P.call("wait_released", [pkey], WAIT) == [pkey]
    assert D.call("block_bytes_equal", [b for b in db if b < 512], CANARY)
    figures("faults", f"unpostable WRITE ({case}) -> 'failed'", elapsed, out[1][:70])


# -- stale and hostile input -------------------------------------------------------------------


def test_stale_and_hostile_input(fp, figures):
    P, D, R = fp.P, fp.D, fp.R
    p_engine = P.call("engine_id")
    n = 30
    tid, pkey, dkey = uid("t"), uid("p"), uid("d")
    pb, db = [90, 91], [100, 101, 102, 103]
    P.call("fill", 11, n, pb)
    c0 = P.call("counters")

    def delta(name):
        return counter(P, name) - c0.get(name, 0.0)

    def wait_delta(name, want):
        wait_counter(P, name, c0.get(name, 0.0) + want)
        return delta(name)

    D.call("expect", dkey, tid, 0, P.call("address"), db, 0, n)
    assert wait_delta("registrations_early", 1) == 1
    # 1. a duplicate registration (same attempt) from the real decoder: stale, dropped
    reg = {"transfer_id": tid, "reg_id": dkey, "attempt": 0, "block_ids": db, "first_token": 0,
           "num_tokens": n}
    assert D.call("inject", "Register", reg, to_engine=p_engine) == 1
    assert wait_delta("rejected{stale}", 1) == 1
    # 2. a registration naming another engine: spoofed
    D.call("inject", "Register", {**reg, "engine_id": "someone-else"}, to_engine=p_engine)
    assert wait_delta("rejected{spoofed}", 1) == 1
    # 3. garbage from a known peer: malformed, and the peer is kept
    D.call("inject", "Heartbeat", raw=b"\x93\x01\xc4\x03abc", to_engine=p_engine)
    assert wait_delta("rejected{malformed}", 1) == 1
    # 4. a third process whose agent loads P's metadata without a handshake
    hostile = [
        Codec().encode(Heartbeat(engine_id="rogue", tp_rank=0, seq=1)),  # well-formed
        Codec().encode(Register(transfer_id=tid, reg_id=dkey, prompt_digest="", attempt=5,
                                engine_id="rogue", tp_rank=0, block_ids=(0, 1), first_token=0,
                                num_tokens=n, geometry_digest="x")),  # aimed at a live transfer
        b"\xff",
        b"definitely not msgpack",
        bytes(random.Random(3).randrange(256) for _ in range(300)),
        msgspec.msgpack.encode(Envelope(PROTOCOL_VERSION + 7, b"\x00")),
    ]
    reasons = []
    for data in hostile:  # what P's codec makes of each (all but the first two are rejected)
        try:
            Codec().decode(data)
            reasons.append("unknown_peer")
        except MessageRejected as e:
            reasons.append(e.reason)
    assert reasons[:2] == ["unknown_peer"] * 2 and "unknown_peer" not in reasons[2:], reasons
    R.call("notify_unknown", P.call("agent_metadata"), hostile)
    for reason in set(reasons):
        want = reasons.count(reason) + (1 if reason == "malformed" else 0)
        assert wait_delta(f"rejected{{{reason}}}", want) == want, reason
    malformed = reasons.count("malformed")
    # P keeps serving: the transfer the rogue aimed at completes untouched
    P.call("prefill_done", pkey, tid, pb, n)
    out = D.call("wait_outcome", dkey, 10)
    assert out is not None and out[0] == "received", out
    assert D.call("verify", 11, n, db, 0) == 0
    assert P.call("wait_released", [pkey], 5) == [pkey]
    push_ok(P, D)
    figures("faults", "hostile input: messages injected / rejected by P",
            f"{3 + len(hostile)} / {int(delta('rejected'))}",
            f"stale 1, spoofed 1, unknown_peer 2, malformed {malformed + 1}, version 1")


# -- authenticated control plane ---------------------------------------------------------------


def test_secret_required(fp, figures):
    Ps, D, R, Ds = fp.Ps, fp.D, fp.R, fp.Ds
    addr = Ps.call("address")
    c0 = Ps.call("counters")

    def fails(dec):
        key = uid("d")
        t0 = time.monotonic()
        dec.call("expect", key, uid("t"), 0, addr, [110, 111], 0, 10)
        out = dec.call("wait_outcome", key, 5)
        assert out is not None and out[0] == "failed", out
        return out[1], time.monotonic() - t0

    reason, t_none = fails(D)  # no secret
    assert "refused" in reason and "uses a shared secret but this decoder has none" in reason, \
        reason
    assert wait_counter(Ps, "rejected{unauthenticated}",
                        c0.get("rejected{unauthenticated}", 0) + 1) >= 1
    reason_wrong, t_wrong = fails(R)  # another secret
    assert "MAC" in reason_wrong or "mac" in reason_wrong, reason_wrong
    assert wait_counter(Ps, "rejected{bad_mac}", c0.get("rejected{bad_mac}", 0) + 1) >= 1
    assert Ps.call("counters").get("handshakes", 0) == c0.get("handshakes", 0)
    latency = push_ok(Ps, Ds)  # the same secret: works
    figures("faults", "handshake without the secret -> refused", t_none, reason[-70:])
    figures("faults", "handshake with a wrong secret -> refused", t_wrong, reason_wrong[-70:])
    figures("faults", "with the same secret: request received and verified", latency)


def test_secret_only_on_the_decoder_is_refused(fp):
    """Today a producer without a secret ignores a decoder's MAC: both sides now refuse."""
    P, Ds = fp.P, fp.Ds
    c0 = P.call("counters")
    key = uid("d")
    Ds.call("expect", key, uid("t"), 0, P.call("address"), [120, 121], 0, 10)
    out = Ds.call("wait_outcome", key, 5)
    assert out is not None and out[0] == "failed", out
    assert "has no shared secret but this decoder has one" in out[1], out
    assert wait_counter(P, "rejected{secret_mismatch}",
                        c0.get("rejected{secret_mismatch}", 0) + 1) >= 1
    assert P.call("counters").get("handshakes", 0) == c0.get("handshakes", 0)


def test_replayed_notifications_are_rejected_over_nixl(fp, figures):
    """The same sealed frame delivered three times through real NIXL: handled once, the two
    replays rejected and counted; the pair keeps working."""
    Ps, Ds = fp.Ps, fp.Ds
    push_ok(Ps, Ds)  # Ds and Ps know each other
    p_engine = Ps.call("engine_id")
    c0 = Ps.call("counters")
    assert Ds.call("inject", "Heartbeat", {"seq": 1}, to_engine=p_engine, times=3) == 3
    assert wait_counter(Ps, "rejected{replay}", c0.get("rejected{replay}", 0) + 2) == \
        c0.get("rejected{replay}", 0) + 2
    latency = push_ok(Ps, Ds)
    figures("faults", "replayed notification (x2) -> rejected{replay}, pair still works", latency)
