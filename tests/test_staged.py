"""Tests for the staged push path (kv_push.common.staged) in-process: no NIXL, no threads.

Real ``Producer``s and ``Decoder``s (one per TP rank) run on ``TransferThread``s that are never
started (``fakes.Node``), on one fake wire; the side channel is a direct call of
``accept_hello``. Pack and unpack are ``FakeOps``: they move no bytes but record what they were
asked to do, and can be held "in flight" (as CUDA ops are until their event completes) or made
to fail. The fake transport's WRITEs deliver their notices (and can be held too). Bytes are
verified over real NIXL in ``test_staged_nixl.py``; here it is the protocol: slots, chunks,
descriptors, ordering, fallbacks and how long slots and source blocks stay held.
"""

from __future__ import annotations

import pytest

from kv_push.common import geometry as G
from kv_push.common.decoder import Decoder, Outcome
from kv_push.common.messages import (
    Cancel, CancelAck, MessageRejected, Register, TransferFailed, WriteDone,
)
from kv_push.common.producer import Producer
from kv_push.common.side_channel import HandshakeError
from kv_push.common.messages import StagingRegion
from kv_push.common.staged import StagedReceiver, StagedSender, StagingMemory
from kv_push.common.staging import slot_layout

from fakes import FakeClock, InlineExecutor, Node, Wire, role_config, settle

SHAPE = dict(num_layers=4, num_kv_heads=2, head_size=8, dtype_bytes=2, dtype="bfloat16",
             block_size=4, num_blocks=16)
VEC = 16  # bytes of one (token, head) vector
P_BASE, D_BASE = 1 << 32, 1 << 36
P_POOL, D_POOL = 1 << 40, 1 << 44  # staging pools' (fake) addresses
HOST, PORT = "10.0.0.7", 7000
POOL = 1 << 20
CHUNK = 2 * 2 * 8 * 2 * VEC  # two layers of 8 tokens x 2 heads, K and V: 2 chunks of 4 layers


class FakeOp:
    def __init__(self, kind: str, offset: int, nbytes: int, layers: range, wait_for=()):
        self.kind, self.offset, self.nbytes, self.layers = kind, offset, nbytes, layers
        self.wait_for = tuple(wait_for)
        self.done = False

    def query(self) -> bool:
        return self.done

    def __repr__(self) -> str:
        return f"<{self.kind} {self.layers.start}-{self.layers.stop} {'done' if self.done else 'busy'}>"


class FakeOps:
    """``StagingOps`` that record calls. ``hold``: new ops stay in flight until ``finish``;
    ``fail``: "prepare", "pack" or "unpack" raises."""

    def __init__(self, asynchronous: bool = True):
        self.asynchronous = asynchronous
        self.ops: list[FakeOp] = []
        self.prepared: list = []
        self.hold = False
        self.fail = ""
        self.markers = 0

    def prepare(self, plan):
        if self.fail == "prepare":
            raise RuntimeError("no device memory for the row ids")
        self.prepared.append(plan)
        return plan

    def _op(self, kind, offset, nbytes, layers, wait_for=()):
        if self.fail == kind:
            raise RuntimeError(f"{kind} kernel failed")
        op = FakeOp(kind, offset, nbytes, layers, wait_for)
        op.done = not self.hold
        self.ops.append(op)
        return op

    def pack(self, prepared, offset, nbytes, layers, wait_for):
        return self._op("pack", offset, nbytes, layers, wait_for)

    def unpack(self, prepared, offset, nbytes, layers):
        return self._op("unpack", offset, nbytes, layers)

    def marker(self):
        self.markers += 1
        return f"event-{self.markers}"

    def of(self, kind: str) -> list[FakeOp]:
        return [o for o in self.ops if o.kind == kind]

    def busy(self) -> list[FakeOp]:
        return [o for o in self.ops if not o.done]

    def finish(self) -> None:
        for o in self.ops:
            o.done = True


def p_geom(tp=1, rank=0, **kw):
    return G.pooled(base=P_BASE + (rank << 28), placement="kv_split", tp_size=tp, tp_rank=rank,
                    **{**SHAPE, **kw})


def d_geom(tp=1, rank=0, **kw):
    return G.pooled(base=D_BASE + (rank << 28), placement="kv_split", tp_size=tp, tp_rank=rank,
                    **{**SHAPE, **kw})


class World:
    """One producer engine "P" (TP ``p_tp``, nodes P<r>) and one decoder engine "D" (TP
    ``d_tp``, nodes D<r>). ``p_pool`` / ``d_pool``: staging pool bytes per rank (0: none)."""

    def __init__(self, *, p_tp=1, d_tp=1, p_pool=POOL, d_pool=POOL, asynchronous=True,
                 p_kw=None, d_kw=None, **config):
        self.wire, self.clock = Wire(), FakeClock()
        cfg = role_config(staging_chunk_bytes=CHUNK, **config)
        self.released: list[str] = []
        self.p_nodes, self.producers, self.p_ops = [], [], []
        for r in range(p_tp):
            node = Node(self.wire, self.clock, f"P{r}", p_geom(p_tp, r, **(p_kw or {})), cfg,
                        engine_id="P")
            ops = FakeOps(asynchronous)
            staged = StagedSender(node.thread, StagingMemory(P_POOL + (r << 32), p_pool, "DRAM",
                                                             0), ops=ops) if p_pool else None
            prod = Producer(node.thread, on_released=self.released.append,
                            side_channel_ports=tuple(PORT + i for i in range(p_tp)),
                            staged=staged)
            node.thread.add_role(prod)
            self.p_nodes.append(node)
            self.producers.append(prod)
            self.p_ops.append(ops)
        self.d_nodes, self.decoders, self.d_ops = [], [], []
        for r in range(d_tp):
            node = Node(self.wire, self.clock, f"D{r}", d_geom(d_tp, r, **(d_kw or {})), cfg,
                        engine_id="D")
            ops = FakeOps(asynchronous)
            staged = StagedReceiver(node.thread, StagingMemory(D_POOL + (r << 32), d_pool,
                                                               "DRAM", 0), ops=ops) \
                if d_pool else None
            dec = Decoder(node.thread, handshake_fn=self.handshake, executor=InlineExecutor(),
                          staged=staged)
            node.thread.add_role(dec)
            self.d_nodes.append(node)
            self.decoders.append(dec)
            self.d_ops.append(ops)

    def handshake(self, host, port, hello, codec, timeout, on_closed=None, on_open=None, on_unproven=None):
        try:
            return self.producers[port - PORT].accept_hello(hello)
        except MessageRejected as e:
            raise HandshakeError(str(e)) from None

    @property
    def nodes(self):
        return self.p_nodes + self.d_nodes

    def settle(self):
        settle(*self.nodes, wire=self.wire)

    def step(self, times=1):
        for _ in range(times):
            for n in self.nodes:
                n.step()

    def expect(self, key="d-1", tid="t1", blocks=(2, 3), first_token=0, num_tokens=8,
               attempt=0, ranks=None):
        for r in range(len(self.decoders)) if ranks is None else ranks:
            dec = self.decoders[r]
            self.d_nodes[r].thread.submit(lambda dec=dec: dec.expect(
                key, tid, attempt, (HOST, PORT), tuple(blocks), first_token, num_tokens))

    def prefill(self, key="p-1", tid="t1", blocks=(0, 1), num_tokens=8):
        for node, prod in zip(self.p_nodes, self.producers):
            marker = prod.staged.marker() if prod.staged else None
            node.thread.submit(lambda prod=prod, m=marker: prod.prefill_done(
                key, tid, tuple(blocks), num_tokens, ready=m))

    def cancel(self, key="d-1", rank=0):
        dec = self.decoders[rank]
        self.d_nodes[rank].thread.submit(lambda: dec.cancel(key))

    def outcomes(self, rank=0) -> list[Outcome]:
        q, out = self.decoders[rank].outcomes, []
        while not q.empty():
            out.append(q.get_nowait())
        return out

    def writes(self, rank=0):
        return self.p_nodes[rank].transport.writes

    def notices(self, rank=0) -> list[WriteDone]:
        codec = self.p_nodes[rank].thread.codec
        return [codec.decode(w.notif) for w in self.writes(rank)]

    def registers(self, rank=0) -> list[Register]:
        codec = self.d_nodes[rank].thread.codec
        msgs = [codec.decode(data) for _, data in self.d_nodes[rank].transport.sent]
        return [m for m in msgs if isinstance(m, Register)]

    def d_pool(self, rank=0):
        return self.decoders[rank].staged.pool

    def p_pool(self, rank=0):
        return self.producers[rank].staged.pool

    def idle(self) -> bool:
        return all(v == 0 for p in self.producers for v in p.live().values()) and all(
            v == 0 for d in self.decoders for v in d.live().values())


def count(node, name, label=None):
    return node.count(name, label)


# -- the staged path -----------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["registration_first", "prefill_first"])
def test_staged_push_chunk_by_chunk_into_the_slot(order):
    w = World()
    if order == "registration_first":
        w.expect()
        w.settle()
        w.prefill()
    else:
        w.prefill()
        w.settle()
        w.expect()
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received")]
    (reg,) = w.registers()
    layout = slot_layout(d_geom(), 1, first_token=0, num_tokens=8)
    assert reg.slot is not None and reg.slot.length >= layout.total_bytes == 4 * 2 * 8 * 2 * VEC
    assert reg.slot.layers_per_chunk == 2
    # one WRITE per chunk, one descriptor each: P's packed bytes -> their place in D's slot
    writes = w.writes()
    assert [len(x.src) for x in writes] == [1, 1] and [len(x.dst) for x in writes] == [1, 1]
    chunks = layout.chunks(0, 2)
    for x, c in zip(writes, chunks):
        assert x.dst[0].tolist() == [D_POOL + reg.slot.offset + c.offset, c.length, 0]
        assert x.src[0, 1] == c.length and P_POOL <= x.src[0, 0] < P_POOL + POOL
    assert [(n.staged, n.chunk, n.chunks, n.layer_lo, n.layer_hi, n.num_bytes)
            for n in w.notices()] == [(True, 0, 2, 0, 2, c.length), (True, 1, 2, 2, 4, c.length)]
    # P packed each chunk into exactly the bytes it then wrote; D unpacked each from its slot
    packs, unpacks = w.p_ops[0].of("pack"), w.d_ops[0].of("unpack")
    assert [(o.offset + P_POOL, o.nbytes, o.layers) for o in packs] == [
        (int(x.src[0, 0]), c.length, c.layers) for x, c in zip(writes, chunks)]
    assert [(o.offset, o.nbytes, o.layers) for o in unpacks] == [
        (reg.slot.offset + c.offset, c.length, c.layers) for c in chunks]
    assert w.released == ["p-1"] and w.idle()
    assert w.d_pool().used_bytes == 0 and w.p_pool().used_bytes == 0
    for node in (w.p_nodes[0], w.d_nodes[0]):
        assert count(node, "staged_transfers") == 1 and count(node, "staged_chunks") == 2
        assert count(node, "staged_bytes") == layout.total_bytes
        assert count(node, "staged_fallback") == 0
    assert count(w.p_nodes[0], "regions_written") == 2


def test_packs_wait_for_the_prefill_and_writes_wait_for_the_packs():
    """CUDA ordering: every pack waits for the event recorded when the prefill was handed over;
    no chunk is posted before its pack completed, and the source blocks (which packs read) and
    P's room are held until every pack ran."""
    w = World()
    w.p_ops[0].hold = True
    w.expect()
    w.settle()
    w.prefill()
    w.settle()
    packs = w.p_ops[0].of("pack")
    assert len(packs) == 2 and all(p.wait_for == ("event-1",) for p in packs)
    assert w.writes() == [] and w.released == []
    packs[0].done = True
    w.settle()
    assert len(w.writes()) == 1 and w.outcomes() == []
    assert w.released == [] and w.p_pool().used_bytes > 0
    packs[1].done = True
    w.settle()
    assert len(w.writes()) == 2
    assert w.outcomes() == [Outcome("d-1", "received")] and w.released == ["p-1"] and w.idle()


def test_received_only_after_the_last_unpack_completed():
    w = World()
    w.d_ops[0].hold = True
    w.expect()
    w.prefill()
    w.settle()
    unpacks = w.d_ops[0].of("unpack")
    assert len(unpacks) == 2 and w.outcomes() == []
    assert w.decoders[0].busy()  # the thread spins while the device works
    assert w.released == ["p-1"]  # P is done: its WRITEs finished
    unpacks[0].done = True
    w.step()
    assert w.outcomes() == [] and w.d_pool().used_bytes > 0
    unpacks[1].done = True
    w.step()
    assert w.outcomes() == [Outcome("d-1", "received")]
    assert w.d_pool().used_bytes == 0 and not w.decoders[0].busy() and w.idle()


def test_host_ops_pack_each_chunk_right_before_its_post():
    """Synchronous (host) ops: a chunk is packed when it is about to be posted, one per loop
    step, never all at once up front."""
    w = World(asynchronous=False)
    w.p_nodes[0].transport.hold_writes = True
    w.expect()
    w.settle()
    w.prefill()
    w.p_nodes[0].thread.step()  # chunks go out at ticks, one per step: chunk 0 now
    packs = w.p_ops[0].of("pack")
    assert [p.layers for p in packs] == [range(0, 2)] and len(w.writes()) == 1
    w.p_nodes[0].thread.step()  # ...and chunk 1, packed right before its post
    packs = w.p_ops[0].of("pack")
    assert [p.layers for p in packs] == [range(0, 2), range(2, 4)] and len(w.writes()) == 2
    w.p_ops[0].ops.clear()
    w.prefill(key="p-2", tid="t2")
    w.expect(key="d-2", tid="t2", blocks=(4, 5))
    for _ in range(6):  # never a pack ahead of its post
        w.step()
        assert len(w.p_ops[0].of("pack")) == len(w.writes()) - 2
    for h in w.p_nodes[0].transport.in_flight():
        w.p_nodes[0].transport.finish(h)
    w.settle()
    assert set(w.outcomes()) == {Outcome("d-1", "received"), Outcome("d-2", "received")}
    assert w.idle()


def test_prefix_hit_stages_only_the_tail():
    w = World()
    w.expect(blocks=(5,), first_token=4, num_tokens=8)
    w.prefill()
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received")]
    (reg,) = w.registers()
    assert reg.slot.length >= slot_layout(d_geom(), 1, first_token=4, num_tokens=8).total_bytes
    assert sum(n.num_bytes for n in w.notices()) == 4 * 2 * 4 * 2 * VEC
    (plan,) = [p for p in w.d_ops[0].prepared]
    assert (plan.first_token, plan.num_tokens) == (4, 8)


def test_full_prefix_hit_reserves_nothing():
    w = World()
    w.expect(blocks=(), first_token=8, num_tokens=8)
    w.prefill()
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received")]
    assert w.registers()[0].slot is None and w.writes() == []
    assert count(w.d_nodes[0], "staged_fallback") == 0 and w.idle()


# -- tensor parallelism ----------------------------------------------------------------------------


def test_producer_tp2_writes_disjoint_sub_slices_of_one_slot():
    w = World(p_tp=2)
    w.expect()
    w.prefill()
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received")]
    regs = w.registers()
    assert len(regs) == 2 and regs[0].slot == regs[1].slot  # one slot, told to both writers
    slot = regs[0].slot
    spans = []
    for r in range(2):
        for x in w.writes(r):
            addr, n, _ = x.dst[0].tolist()
            assert D_POOL + slot.offset <= addr and addr + n <= D_POOL + slot.offset + slot.length
            spans.append((addr, addr + n))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    # each writer's chunks landed in its own sub-slice, and D unpacked each with its plan
    layout = slot_layout(d_geom(), 2, first_token=0, num_tokens=8)
    for r in range(2):
        ws = layout.writer(r)
        for x in w.writes(r):
            assert ws.offset <= x.dst[0, 0] - D_POOL - slot.offset < ws.offset + ws.length
    assert sorted(p.heads for p in w.d_ops[0].prepared) == [(0, 1), (1, 2)]
    n_chunks = sum(len(layout.chunks(r, slot.layers_per_chunk)) for r in range(2))
    assert len(w.d_ops[0].of("unpack")) == n_chunks == len(w.writes(0)) + len(w.writes(1))
    assert sorted(w.released) == ["p-1", "p-1"] and w.idle()


def test_producer_tp1_packs_separately_for_each_decoder_rank():
    w = World(d_tp=2)
    w.p_nodes[0].transport.hold_writes = True
    w.expect()
    w.prefill()
    w.settle()
    plans = w.p_ops[0].prepared
    assert sorted(p.heads for p in plans) == [(0, 1), (1, 2)]
    # both in flight at once: their rooms in P's pool are disjoint
    rooms = sorted((int(x.src[0, 0]), int(x.src[0, 0] + x.src[0, 1])) for x in w.writes())
    assert len(rooms) == 2 and rooms[0][1] <= rooms[1][0]
    assert sorted(x.peer for x in w.writes()) == ["D0", "D1"]
    assert w.p_pool().used_bytes >= 2 * 1024
    for h in w.p_nodes[0].transport.in_flight():
        w.p_nodes[0].transport.finish(h)
    w.settle()
    assert w.outcomes(0) == [Outcome("d-1", "received")]
    assert w.outcomes(1) == [Outcome("d-1", "received")]
    assert w.released == ["p-1"] and w.idle()


# -- fallbacks ---------------------------------------------------------------------------------------


def test_no_free_slot_on_the_decoder_takes_the_region_path():
    w = World(d_pool=4096)  # smaller than the request's 4 KiB... plus nothing else fits
    w.expect(key="d-0", tid="t0", blocks=(8, 9))  # takes the whole pool
    w.expect(key="d-1", tid="t1", blocks=(2, 3))
    w.settle()
    regs = {r.transfer_id: r for r in w.registers()}
    assert regs["t0"].slot is not None and regs["t1"].slot is None
    assert count(w.d_nodes[0], "staged_fallback", "no_slot") == 1
    w.prefill(key="p-1", tid="t1")
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received")]
    assert not any(n.staged for n in w.notices()) and w.d_ops[0].of("unpack") == []
    assert w.d_pool().used_bytes == 4096  # t0 still holds its slot
    w.prefill(key="p-0", tid="t0")
    w.settle()
    assert w.outcomes() == [Outcome("d-0", "received")] and w.idle()


def test_a_producer_without_staging_gets_no_slot():
    w = World(p_pool=0)
    w.expect()
    w.prefill()
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received")]
    assert w.registers()[0].slot is None
    assert count(w.d_nodes[0], "staged_fallback", "peer") == 1
    assert w.d_pool().reserves == 0 and not any(n.staged for n in w.notices()) and w.idle()


def test_a_decoder_without_staging_announces_none():
    w = World(d_pool=0)
    w.expect()
    w.prefill()
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received")]
    assert w.producers[0].staged.regions == {}
    assert w.registers()[0].slot is None and w.p_ops[0].ops == [] and w.idle()


def test_no_room_on_the_producer_writes_regions_and_the_decoder_unpacks_nothing():
    w = World(p_pool=1024)
    w.expect()
    w.prefill()
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received")]
    assert w.registers()[0].slot is not None  # D offered a slot; P could not use it
    assert count(w.p_nodes[0], "staged_fallback", "producer_pool") == 1
    notices = w.notices()
    assert notices and not any(n.staged for n in notices)
    assert all(int(x.dst[0, 0]) >= D_BASE and int(x.dst[0, 0]) < D_POOL for x in w.writes())
    assert w.d_ops[0].of("unpack") == [] and w.d_pool().used_bytes == 0 and w.idle()


def test_a_slot_outside_the_announced_region_is_refused_and_regions_are_written():
    w = World()
    w.expect()
    w.settle()
    (reg,) = w.registers()
    # as if D had announced a region too small for the slot it then sent (hostile or broken)
    w.producers[0].staged.regions["D0"] = StagingRegion(base=D_POOL, length=reg.slot.offset + 8)
    w.prefill()
    w.settle()
    assert count(w.p_nodes[0], "staged_fallback", "bad_slot") == 1
    assert count(w.p_nodes[0], "rejected", "bad_slot") == 1
    assert not any(n.staged for n in w.notices())
    assert w.outcomes() == [Outcome("d-1", "received")] and w.idle()


def test_failing_unpack_plan_preparation_falls_back():
    w = World()
    w.d_ops[0].fail = "prepare"
    w.expect()
    w.prefill()
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received")]
    assert count(w.d_nodes[0], "staged_fallback", "error") == 1
    assert w.registers()[0].slot is None and w.d_pool().used_bytes == 0 and w.idle()


def test_staging_switched_off_at_run_time():
    w = World()
    w.decoders[0].staged.enabled = False
    w.expect()
    w.prefill()
    w.settle()
    assert w.registers()[0].slot is None
    assert count(w.d_nodes[0], "staged_fallback", "off") == 1
    assert w.outcomes() == [Outcome("d-1", "received")] and w.idle()


# -- fencing: slots live exactly as long as their blocks stay fenced --------------------------------


def test_cancel_while_unpacking_waits_for_the_unpack():
    w = World()
    w.d_ops[0].hold = True
    w.expect()
    w.prefill()
    w.settle()
    assert len(w.d_ops[0].of("unpack")) == 2
    w.cancel()
    w.settle()
    # P has nothing in flight: it acknowledged at once; the unpack still writes D's blocks
    assert w.outcomes() == [] and w.d_pool().used_bytes > 0
    w.d_ops[0].finish()
    w.step()
    assert w.outcomes() == [Outcome("d-1", "released", "aborted")]
    assert w.d_pool().used_bytes == 0 and w.idle()


def test_cancel_while_writing_keeps_the_slot_until_acknowledged_and_skips_the_unpack():
    w = World()
    w.p_ops[0].hold = True
    w.p_nodes[0].transport.hold_writes = True
    w.expect()
    w.prefill()
    w.settle()
    packs = w.p_ops[0].of("pack")
    packs[0].done = True
    w.settle()
    (first,) = w.p_nodes[0].transport.in_flight()  # chunk 0 in flight, chunk 1 still packing
    w.cancel()
    w.settle()
    assert w.outcomes() == [] and w.d_pool().used_bytes > 0  # fenced: P may still write
    packs[1].done = True
    w.settle()
    assert len(w.writes()) == 1  # cancelled: chunk 1 is never posted
    assert w.outcomes() == [] and w.d_pool().used_bytes > 0
    w.p_nodes[0].transport.finish(first)  # its notice reaches D, fenced: counted, not unpacked
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "released", "aborted")]
    assert w.d_ops[0].of("unpack") == [] and w.d_pool().used_bytes == 0
    assert w.released == ["p-1"] and w.p_pool().used_bytes == 0 and w.idle()
    assert count(w.d_nodes[0], "staged_transfers") == 0


def test_cancel_while_packing_acknowledges_after_the_packs():
    w = World()
    w.p_ops[0].hold = True
    w.expect()
    w.prefill()
    w.settle()
    w.cancel()
    w.settle()
    # no WRITE was ever posted, but the packs still read P's source blocks
    assert w.writes() == [] and w.released == [] and w.p_pool().used_bytes > 0
    assert w.outcomes() == []
    w.p_ops[0].finish()
    w.settle()
    assert w.writes() == []
    assert w.outcomes() == [Outcome("d-1", "released", "aborted")]
    assert w.released == ["p-1"] and w.p_pool().used_bytes == 0 and w.idle()


def test_decoder_death_while_packing_holds_the_source_until_the_packs_ran():
    w = World()
    w.p_ops[0].hold = True
    w.expect()
    w.prefill()
    w.settle()
    peer = w.p_nodes[0].thread.peers["D0"]
    w.p_nodes[0].thread.drop_peer(peer, "lifeline closed")
    w.p_nodes[0].step()
    assert w.released == [] and w.producers[0].live()["jobs"] == 1
    w.p_ops[0].finish()
    w.p_nodes[0].step()
    assert w.released == ["p-1"] and w.p_pool().used_bytes == 0
    assert w.producers[0].live() == {"sources": 0, "jobs": 0, "rendezvous": 0, "claims": 0,
                                     "staging_rooms": 0, "streams": 0}


def test_producer_death_while_unpacking_fails_after_the_unpack():
    w = World()
    w.d_ops[0].hold = True
    w.p_nodes[0].transport.hold_writes = True
    w.expect()
    w.prefill()
    w.settle()
    w.p_nodes[0].transport.finish(w.p_nodes[0].transport.in_flight()[0])
    w.settle()  # chunk 0 arrived and is unpacking; chunk 1 is being written
    assert len(w.d_ops[0].of("unpack")) == 1
    w.d_nodes[0].thread.drop_peer(w.d_nodes[0].thread.peers["P0"], "lifeline closed")
    w.d_nodes[0].step()
    assert w.outcomes() == [] and w.d_pool().used_bytes > 0
    w.d_ops[0].finish()
    w.d_nodes[0].step()
    (o,) = w.outcomes()
    assert o.kind == "failed" and "dead" in o.reason and w.d_pool().used_bytes == 0


def test_time_out_while_unpacking_waits_for_the_unpack():
    w = World(transfer_timeout_s=30.0)
    w.d_ops[0].hold = True
    w.expect()
    w.prefill()
    w.settle()
    w.clock.advance(31)
    w.settle()
    assert count(w.d_nodes[0], "expired") == 1
    assert w.outcomes() == []  # failed, fenced: P acknowledged, the unpack still runs
    w.d_ops[0].finish()
    w.step()
    (o,) = w.outcomes()
    assert o.kind == "failed" and w.d_pool().used_bytes == 0 and w.idle()


def test_a_failed_unpack_fails_the_request_and_frees_the_slot():
    w = World()
    w.d_ops[0].fail = "unpack"
    w.expect()
    w.prefill()
    w.settle()
    (o,) = w.outcomes()
    assert o.kind == "failed" and "unpack" in o.reason
    assert count(w.d_nodes[0], "rejected", "staging") == 1
    assert w.d_pool().used_bytes == 0 and w.idle()


def test_a_failed_pack_is_reported_to_the_decoder():
    w = World()
    w.p_ops[0].fail = "pack"
    w.expect()
    w.prefill()
    w.settle()
    (o,) = set(w.outcomes())  # a set: issue 9 item 2 (a TransferFailed emits it twice)
    assert o.kind == "failed" and "pack" in o.reason
    assert w.released == ["p-1"] and w.p_pool().used_bytes == 0 and w.idle()
    assert count(w.p_nodes[0], "transfers_failed") == 1


# -- notices that do not fit the slot ----------------------------------------------------------------


def staged_notice(**kw):
    fields = dict(transfer_id="t1", reg_id="d-1", attempt=0, engine_id="P", tp_rank=0, num_bytes=CHUNK,
                  chunk=0, chunks=2, staged=True, layer_lo=0, layer_hi=2)
    return WriteDone(**{**fields, **kw})


@pytest.mark.parametrize("notice,why", [
    (staged_notice(layer_lo=1, layer_hi=3), "invalid"),
    (staged_notice(num_bytes=CHUNK - 1), "invalid"),
    (staged_notice(chunks=3, chunk=2, layer_lo=4, layer_hi=6), "invalid"),
])
def test_a_notice_that_does_not_fit_the_slot_fails_the_request(notice, why):
    w = World()
    w.expect()
    w.settle()
    w.p_nodes[0].thread.send("D0", notice)
    w.settle()
    (o,) = w.outcomes()
    assert o.kind == "failed"
    assert count(w.d_nodes[0], "rejected", why) == 1
    assert w.d_ops[0].of("unpack") == [] and w.d_pool().used_bytes == 0


def test_a_duplicate_chunk_is_rejected():
    w = World()
    w.d_ops[0].hold = True
    w.expect()
    w.settle()
    w.p_nodes[0].thread.send("D0", staged_notice())
    w.p_nodes[0].thread.send("D0", staged_notice())
    w.settle()
    assert count(w.d_nodes[0], "rejected", "invalid") == 1
    assert len(w.d_ops[0].of("unpack")) == 1  # the first was unpacked; the request failed
    assert w.outcomes() == []  # ...and waits for that unpack before it lets the blocks go
    w.d_ops[0].finish()
    w.step()
    assert [o.kind for o in w.outcomes()] == ["failed"] and w.d_pool().used_bytes == 0


def test_a_staged_notice_without_a_slot_is_rejected():
    w = World(d_pool=1024)  # too small: registered without a slot
    w.expect()
    w.settle()
    assert w.registers()[0].slot is None
    w.p_nodes[0].thread.send("D0", staged_notice())
    w.settle()
    assert count(w.d_nodes[0], "rejected", "unexpected") == 1
    assert [o.kind for o in w.outcomes()] == ["failed"]


def test_mixing_staged_and_region_notices_is_rejected():
    w = World()
    w.expect()
    w.settle()
    w.p_nodes[0].thread.send("D0", staged_notice())
    w.p_nodes[0].thread.send("D0", WriteDone(transfer_id="t1", reg_id="d-1", attempt=0,
                                             engine_id="P",
                                             tp_rank=0, num_bytes=64, chunk=1, chunks=2))
    w.settle()
    assert count(w.d_nodes[0], "rejected", "invalid") == 1
    assert [o.kind for o in w.outcomes()] == ["failed"]


def test_messages_in_the_fenced_state_still_resolve_the_writer():
    """A fenced request counts staged chunks to resolve the writer but never unpacks them; the
    producer's CancelAck resolves it too: whichever comes, the slot is freed once."""
    w = World()
    w.p_nodes[0].transport.hold_writes = True
    w.expect()
    w.prefill()
    w.settle()
    w.cancel()
    w.d_nodes[0].step()  # Cancel sent; P has not seen it yet
    assert isinstance(w.d_nodes[0].thread.codec.decode(w.d_nodes[0].transport.sent[-1][1]),
                      Cancel)
    t = w.p_nodes[0].transport
    w.settle()
    for h in t.in_flight():
        t.finish(h)
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "released", "aborted")]
    assert w.d_pool().used_bytes == 0 and w.d_ops[0].of("unpack") == [] and w.idle()
    acks = [m for _, m in ((s, w.p_nodes[0].thread.codec.decode(d))
                           for s, d in w.p_nodes[0].transport.sent) if isinstance(m, CancelAck)]
    assert len(acks) == 1
    assert not [m for _, d in w.p_nodes[0].transport.sent
                if isinstance(m := w.p_nodes[0].thread.codec.decode(d), TransferFailed)]


# -- per-request identity (reg_id, attempt) ------------------------------------------------------


def test_a_superseded_attempt_keeps_its_slot_until_its_staged_chunks_are_accounted_for():
    """The engine re-allocates (attempt 1) while attempt 0's staged chunks are in flight: the
    old slot stays reserved, next to the new attempt's own, until the producer's answer says how
    many staged chunks completed (``chunks_done`` counts them) and those notices arrived --
    counted, not unpacked. Only attempt 1 is unpacked and reported."""
    w = World()
    t = w.p_nodes[0].transport
    t.hold_writes = True
    w.expect(attempt=0)
    w.prefill()
    w.settle()
    old = t.in_flight()
    assert len(old) == 2 and all(n.staged and n.attempt == 0 for n in w.notices())
    (reg0,) = w.registers()
    w.expect(attempt=1, blocks=(6, 7))
    w.settle()
    regs = w.registers()
    assert [r.attempt for r in regs] == [0, 1] and regs[1].slot.offset != reg0.slot.offset
    assert w.d_pool().used_bytes == 2 * reg0.slot.length  # both slots held
    assert w.outcomes() == []
    for h in old:
        t.finish(h)
    w.settle()
    acks = [m for m in (w.p_nodes[0].thread.codec.decode(d) for _, d in t.sent)
            if isinstance(m, CancelAck)]
    assert [(a.reg_id, a.attempt, a.chunks_done) for a in acks] == [("d-1", 0, 2)]
    for h in t.in_flight():
        t.finish(h)
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received", "", 1)]
    unpacks = w.d_ops[0].of("unpack")
    assert len(unpacks) == 2 and all(
        regs[1].slot.offset <= u.offset < regs[1].slot.offset + regs[1].slot.length
        for u in unpacks)
    assert w.d_pool().used_bytes == 0 and w.p_pool().used_bytes == 0 and w.idle()


def test_staged_notices_name_the_decoder_request():
    """Two engine requests of one transfer (n > 1) each get their own slot and their own staged
    chunks, told apart by ``reg_id``."""
    w = World()
    w.expect(key="d-1", blocks=(2, 3))
    w.expect(key="d-2", blocks=(4, 5))
    w.settle()
    for p, node in zip(w.producers, w.p_nodes):
        node.thread.submit(lambda p=p: p.prefill_done("p-1", "t1", (0, 1), 8, capacity=2))
    w.settle()
    assert set(w.outcomes()) == {Outcome("d-1", "received"), Outcome("d-2", "received")}
    assert sorted({n.reg_id for n in w.notices()}) == ["d-1", "d-2"]
    assert all(n.staged for n in w.notices()) and len(w.d_ops[0].of("unpack")) == 4
    assert w.released == ["p-1"] and w.idle()
