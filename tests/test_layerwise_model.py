"""A seeded random check of layer-wise streaming: real producers and decoders (``test_staged``'s
``World``: never-started transfer threads, a fake wire, fake pack/unpack ops and WRITEs that can
be held in flight) driven through random interleavings of what the engines, the device, NIXL
and the router may do around a streamed prefill:

* P's engine, per prefill, in order: ``prefill_started``; ``layer_saved`` for some layers (in
  order, maybe not all: CUDA graphs report none); ``step_saved``; then ``prefill_done`` or --
  the request aborted -- ``prefill_failed`` naming it (its blocks held for the producer);
* D's engine: registrations at any moment (before, during or after the prefill), some with a
  prefix of their own (their slot wants other bytes than the stream's), several per prefill
  (``fanout``); cancels;
* the device: packs and unpacks complete at random later moments; NIXL: WRITEs land later;
* the router: ``Release`` of a transfer id at any moment; time passes (TTLs).

Invariants, checked after every action:

1. no pack reads a layer before the engine reported it written (``layer_saved`` of that
   layer, or the step's end) -- packs wait for the event of the call that enqueued them, so
   enqueuing one earlier would read KV not yet computed;
2. no WRITE is posted from P's staging room before every pack that fills its bytes completed;
3. P hands a prefill's blocks back to its engine at most once per rank, never before the
   engine finished the request (``prefill_done`` / ``prefill_failed``), and never while a pack
   reading them still runs (seen in the producer's own calls, reported at the next check);
5. no WRITE for a registration attempt P has already answered (cancel acknowledged, or told
   failed): the decoder frees those blocks;
4. at quiescence: every prefill released on every rank, every decoder request answered exactly
   once per rank (or cancelled), "received" ones with all their chunks unpacked, nothing held
   (sources, jobs, claims, streams, rooms, slots).

``KV_PUSH_LW_RUNS`` sets the number of seeded runs (default 1000); a failure names its seed.
"""

from __future__ import annotations

import os
import random

import pytest

from kv_push.common.messages import CancelAck, TransferFailed

from test_staged import World

RUNS = int(os.environ.get("KV_PUSH_LW_RUNS", "1000"))
LAYERS, TOKENS, BS = 4, 8, 4


class Run:
    def __init__(self, seed: int):
        self.rng = rng = random.Random(seed)
        self.seed = seed
        p_tp, d_tp = rng.choice([(1, 1), (1, 1), (2, 1), (1, 2), (2, 2)])
        p_pool = rng.choice([1 << 20, 1 << 20, 8192])  # 8 KiB: room for few streams
        self.w = World(p_tp=p_tp, d_tp=d_tp, p_pool=p_pool, d_kw=dict(num_blocks=64),
                       p_kw=dict(num_blocks=64))
        self.trace: list[str] = []
        self.prefills = []  # dicts: key, tid, blocks, capacity, stage, reported
        self.decodes = []  # dicts: key, tid, state
        d_next = iter(range(64))
        p_next = iter(range(64))
        for t in range(rng.randint(1, 3)):
            tid = f"t{t}"
            cap = rng.choice([1, 1, 2])
            self.prefills.append(dict(key=f"p{t}", tid=tid, blocks=(next(p_next), next(p_next)),
                                      capacity=cap, stage="new", reported=set(), fail=False))
            for j in range(cap):
                first = rng.choice([0, 0, 0, BS])
                blocks = tuple(next(d_next) for _ in range((TOKENS - first) // BS))
                self.decodes.append(dict(key=f"d{t}-{j}", tid=tid, first=first, blocks=blocks,
                                         state="new"))
        self.w.p_ops_hold = False
        for ops in self.w.p_ops + self.w.d_ops:
            ops.hold = rng.random() < 0.6
        for node in self.w.p_nodes:
            node.transport.hold_writes = rng.random() < 0.5
        self.finished: set[tuple[int, str]] = set()  # (P rank, key) the engine finished
        self.rel: list[set[str]] = [set() for _ in range(p_tp)]
        self.released: dict[tuple[int, str], int] = {}
        self.seen_packs = [0] * p_tp
        self.seen_writes = [0] * p_tp
        self.outcomes: dict[tuple[int, str], list] = {}
        self.step = None  # P's engine step now running: its prefills, the next layer
        self.violations: list[str] = []  # seen inside the roles' calls (whose errors they catch)
        self.ended: list[set[str]] = [set() for _ in range(p_tp)]  # streams whose room went
        for r, prod in enumerate(self.w.producers):
            self._watch(r, prod)
            self._watch_wire(r)

    def _watch_wire(self, r: int) -> None:
        """Invariant 5: once P answered a registration attempt (``CancelAck`` or
        ``TransferFailed``: the decoder may free or reuse its blocks), no WRITE for that
        attempt is posted any more."""
        node = self.w.p_nodes[r]
        codec = node.thread.codec
        answered: set = set()
        send, write = node.transport.send_notif, node.transport.write

        def send_notif(peer, data):
            msg = codec.decode(data)
            if isinstance(msg, (CancelAck, TransferFailed)):
                answered.add((peer, msg.reg_id, msg.attempt))
            return send(peer, data)

        def write_(peer, src, dst, src_mem, dst_mem, notif):
            msg = codec.decode(notif)
            if (peer, msg.reg_id, msg.attempt) in answered:
                self.violations.append(f"P{r} WRITEs {msg.reg_id}@{msg.attempt} to {peer} "
                                       "after answering it")
            return write(peer, src, dst, src_mem, dst_mem, notif)

        node.transport.send_notif = send_notif
        node.transport.write = write_

    def _watch(self, r: int, prod) -> None:
        """Invariant 3 at the moment it matters: a stream's room (and blocks) go only once no
        pack of it runs; the engine gets the blocks back only after that, once per rank."""
        end, released = prod.staged.end_stream, prod.on_released

        def end_stream(stream):
            busy = [h for h in stream.packs.values() if not h.query()]
            if busy:
                self.violations.append(f"P{r} ended the stream of {stream.key} while {busy} run")
            self.ended[r].add(stream.key)
            end(stream)

        def on_released(key):
            if (r, key) not in self.finished:
                self.violations.append(f"P{r} released {key} before its engine finished it")
            if key in self.rel[r]:
                self.violations.append(f"P{r} released {key} twice")
            if (prod.streams.get(key) or prod._ending.get(key)) is not None:
                self.violations.append(f"P{r} released {key} while its stream is live")
            self.rel[r].add(key)
            released(key)

        prod.staged.end_stream = end_stream
        prod.on_released = on_released

    # -- actions ----------------------------------------------------------------------------
    def note(self, s: str) -> None:
        self.trace.append(s)

    def act(self) -> bool:
        rng, w = self.rng, self.w
        choices = []
        for p in self.prefills:
            if p["stage"] != "over":
                choices.append(("prefill", p))
        for d in self.decodes:
            if d["state"] in ("new", "expected"):
                choices.append(("decode", d))
        choices += [("device", None)] * 3 + [("nixl", None)] * 2 + [("time", None)]
        if rng.random() < 0.05:
            choices.append(("release", rng.choice(self.prefills)))
        kind, what = rng.choice(choices)
        getattr(self, f"_{kind}")(what)
        return True

    def _prefill(self, p) -> None:
        """P's engine: a step starts (some new prefills), reports its layers, ends; a prefill
        that ran is then finished (done, or aborted). One step at a time, as in vLLM."""
        w, rng = self.w, self.rng
        step = self.step
        if p["stage"] == "new" and step is None:
            batch = [p] + [q for q in self.prefills if q is not p and q["stage"] == "new"
                           and rng.random() < 0.3]
            self.step = step = {"prefills": batch, "layer": 0}
            for q in batch:
                self.note(f"P started {q['key']}")
                for node, prod in zip(w.p_nodes, w.producers):
                    node.thread.submit(lambda prod=prod, q=q: prod.prefill_started(
                        q["key"], q["tid"], q["blocks"], TOKENS, capacity=q["capacity"]))
                q["stage"] = "step"
        elif step is not None and (p["stage"] != "ran" or rng.random() < 0.5):
            if step["layer"] < LAYERS and rng.random() < 0.8:
                layer = step["layer"]
                step["layer"] += 1
                self.note(f"P layer {layer}")
                for node, prod in zip(w.p_nodes, w.producers):
                    m = prod.staged.marker()
                    node.thread.submit(lambda prod=prod, m=m: prod.layer_saved(layer, m))
                for q in step["prefills"]:
                    q["reported"].add(layer)
            else:
                self.note("P step end")
                for node, prod in zip(w.p_nodes, w.producers):
                    m = prod.staged.marker()
                    node.thread.submit(lambda prod=prod, m=m: prod.step_saved(m))
                for q in step["prefills"]:
                    q["reported"] = set(range(LAYERS))
                    q["stage"] = "ran"
                self.step = None
        elif p["stage"] == "ran":
            p["stage"] = "over"
            for r in range(len(w.p_nodes)):
                self.finished.add((r, p["key"]))
            if rng.random() < 0.2:
                self.note(f"P engine: {p['key']} ended aborted")
                p["fail"] = True
                for node, prod in zip(w.p_nodes, w.producers):
                    node.thread.submit(lambda prod=prod: prod.prefill_failed(
                        p["tid"], "aborted", capacity=p["capacity"], key=p["key"]))
            else:
                self.note(f"P engine: {p['key']} done")
                for node, prod in zip(w.p_nodes, w.producers):
                    m = prod.staged.marker()
                    node.thread.submit(lambda prod=prod, m=m: prod.prefill_done(
                        p["key"], p["tid"], p["blocks"], TOKENS, capacity=p["capacity"],
                        ready=m))

    def _decode(self, d) -> None:
        w = self.w
        if d["state"] == "new":
            self.note(f"D expects {d['key']} from token {d['first']}")
            w.expect(key=d["key"], tid=d["tid"], blocks=d["blocks"], first_token=d["first"],
                     num_tokens=TOKENS)
            d["state"] = "expected"
        elif self.rng.random() < 0.3:
            self.note(f"D cancels {d['key']}")
            for r in range(len(w.d_nodes)):
                w.cancel(key=d["key"], rank=r)
            d["state"] = "cancelled"

    def _device(self, _) -> None:
        ops = [o for side in (self.w.p_ops, self.w.d_ops) for x in side for o in x.busy()]
        if ops:
            op = self.rng.choice(ops)
            op.done = True
            self.note(f"device: {op!r} done")

    def _nixl(self, _) -> None:
        for node in self.w.p_nodes:
            flying = node.transport.in_flight()
            if flying:
                node.transport.finish(self.rng.choice(flying))
                self.note("nixl: a WRITE landed")
                return

    def _time(self, _) -> None:
        self.w.clock.advance(self.rng.choice([0.01, 0.5, 5.0]))

    def _release(self, p) -> None:
        self.note(f"router releases {p['tid']}")
        for node, prod in zip(self.w.p_nodes, self.w.producers):
            node.thread.submit(lambda prod=prod: prod.release([p["tid"]]))

    # -- invariants ---------------------------------------------------------------------------
    def check(self) -> None:
        w = self.w
        assert not self.violations, self.violations[0]
        for r, (node, prod, ops) in enumerate(zip(w.p_nodes, w.producers, w.p_ops)):
            stream_rooms = {k: (s.offset, s.length, s.plan.layer_bytes)
                            for k, s in prod.streams.items()}
            for op in ops.of("pack")[self.seen_packs[r]:]:
                for key, (off, n, lb) in stream_rooms.items():
                    if off <= op.offset < off + n:
                        p = next(x for x in self.prefills if x["key"] == key)
                        early = set(op.layers) - p["reported"]
                        assert not early, f"P{r} packed layers {early} of {key} before they " \
                                          "were reported written"
            self.seen_packs[r] = len(ops.of("pack"))
            for x in node.transport.writes[self.seen_writes[r]:]:
                mem = w.producers[r].staged.memory
                lo = int(x.src[0, 0]) - mem.address
                hi = lo + int(x.src[0, 1])
                if not 0 <= lo < mem.nbytes:
                    continue  # the region path: it reads the KV blocks, not the room
                covering = [o for o in ops.of("pack") if o.offset < hi and lo < o.offset + o.nbytes]
                assert sum(min(hi, o.offset + o.nbytes) - max(lo, o.offset)
                           for o in covering if o.done) >= hi - lo, \
                    f"P{r} posted a WRITE of room bytes [{lo}, {hi}) not all packed"
            self.seen_writes[r] = len(node.transport.writes)
        for r in range(len(w.d_nodes)):
            for o in w.outcomes(r):
                self.outcomes.setdefault((r, o.key), []).append(o.kind)

    def quiesce(self) -> None:
        w = self.w
        for _ in range(100):  # the engines finish what they started
            left = [p for p in self.prefills if p["stage"] != "over"]
            if not left:
                break
            self._prefill(left[0] if self.step is None else self.step["prefills"][0])
            w.settle()
            self.check()
        for d in self.decodes:
            if d["state"] == "new":
                self._decode(d)
        for ops in w.p_ops + w.d_ops:
            ops.hold = False
        for node in w.p_nodes:
            node.transport.hold_writes = False
        for _ in range(60):
            for ops in w.p_ops + w.d_ops:
                ops.finish()
            for node in w.p_nodes:
                for h in node.transport.in_flight():
                    node.transport.finish(h)
            w.settle()
            self.check()
            w.clock.advance(5.0)
        self.check()

    def verify_end(self) -> None:
        w = self.w
        for p in self.prefills:
            for r in range(len(w.p_nodes)):
                assert p["key"] in self.rel[r], f"P{r} never released {p['key']}"
        for d in self.decodes:
            for r in range(len(w.d_nodes)):
                got = self.outcomes.get((r, d["key"]), [])
                assert len(got) == 1, f"D{r} {d['key']} ({d['state']}): outcomes {got}"
        for prod in w.producers:
            assert all(v == 0 for v in prod.live().values()), prod.live()
            assert prod.staged.pool.used_bytes == 0
        for dec in w.decoders:
            assert all(v == 0 for v in dec.live().values()), dec.live()


@pytest.mark.parametrize("chunk", range(4))
def test_random_interleavings_of_streamed_prefills(chunk):
    per = -(-RUNS // 4)
    for seed in range(chunk * per, min(RUNS, (chunk + 1) * per)):
        run = Run(seed)
        try:
            for _ in range(run.rng.randint(10, 60)):
                run.act()
                run.w.settle()
                run.check()
            run.quiesce()
            run.verify_end()
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}\nlast actions:\n  " +
                                 "\n  ".join(run.trace[-25:])) from None
