"""Layer-wise streaming on the producer (``producer.py``, "Layer-wise streaming"), in-process.

The staged path's ``World`` (``test_staged.py``: real producers and decoders on never-started
transfer threads, a fake wire and fake pack/unpack ops) drives the new engine calls the way the
connector does within one step: ``prefill_started`` before the forward, ``layer_saved`` per
layer, ``step_saved`` at its end, ``prefill_done`` (or ``prefill_failed`` naming the request)
afterwards. What is checked: chunks go out while the prefill still runs, nothing is posted
before its layers are packed, a stream source is released only after its prefill completed and
its packs ran, pairings the stream cannot serve wait for the complete prefill, and an aborted
streamed prefill fails what it had not written and frees its blocks.
"""

from __future__ import annotations

import pytest

from kv_push.common.decoder import Outcome

from test_staged import World, count

KEY, TID, BLOCKS, TOKENS = "p-1", "t1", (0, 1), 8


def start(w: World, key=KEY, tid=TID, blocks=BLOCKS, num_tokens=TOKENS, capacity=1):
    for node, prod in zip(w.p_nodes, w.producers):
        node.thread.submit(lambda prod=prod: prod.prefill_started(
            key, tid, tuple(blocks), num_tokens, capacity=capacity))


def layer(w: World, i: int):
    for node, prod in zip(w.p_nodes, w.producers):
        marker = prod.staged.marker()
        node.thread.submit(lambda prod=prod, m=marker: prod.layer_saved(i, m))


def step_end(w: World):
    for node, prod in zip(w.p_nodes, w.producers):
        marker = prod.staged.marker()
        node.thread.submit(lambda prod=prod, m=marker: prod.step_saved(m))


def first_chunk_reported(w: World):
    """D registers, the prefill starts, layers 0-1 (chunk 0) are reported."""
    w.expect()
    w.settle()
    start(w)
    layer(w, 0)
    layer(w, 1)
    w.settle()


def first_chunk_out(w: World):
    """As :func:`first_chunk_reported`, and chunk 0 is written."""
    first_chunk_reported(w)
    assert len(w.writes()) == 1


def whole_step(w: World, layers=range(4)):
    """The step's layers reported one by one, then its end; the workers settle."""
    for i in layers:
        layer(w, i)
    step_end(w)
    w.settle()


def failed(w: World, key=KEY, tid=TID, reason="aborted", abandoned=""):
    for node, prod in zip(w.p_nodes, w.producers):
        node.thread.submit(lambda prod=prod: prod.prefill_failed(tid, reason, key=key,
                                                                 abandoned=abandoned))


def received(w: World, rank=0):
    return [o for o in w.outcomes(rank) if o.kind == "received"]


def test_chunks_go_out_while_the_prefill_runs():
    """Registration first (the usual order in push): each chunk (2 layers here) is WRITTEN as
    soon as its layers were saved and packed -- before the step ends; the decoder has the KV
    before ``prefill_done``; the source is released only after it."""
    w = World()
    w.expect()
    w.settle()
    start(w)
    w.settle()
    assert w.writes() == [] and w.p_ops[0].of("pack") == []
    layer(w, 0)
    w.settle()
    assert w.writes() == []  # chunk 0 is layers 0-1
    layer(w, 1)
    w.settle()
    assert len(w.writes()) == 1 and w.notices()[0].chunk == 0
    layer(w, 2)
    layer(w, 3)
    w.settle()
    assert len(w.writes()) == 2
    assert w.outcomes() == [Outcome("d-1", "received")]  # before the prefill is "done"
    packs = w.p_ops[0].of("pack")
    assert [p.layers for p in packs] == [range(i, i + 1) for i in range(4)]
    assert [p.wait_for for p in packs] == [(f"event-{i + 1}",) for i in range(4)]
    assert w.released == []  # vLLM has not finished the request yet
    step_end(w)
    w.prefill()
    w.settle()
    assert len(w.p_ops[0].of("pack")) == 4  # nothing packed twice
    assert w.released == [KEY] and w.idle() and w.p_pool().used_bytes == 0
    p = w.p_nodes[0]
    assert count(p, "layerwise_streams") == 1 and count(p, "layerwise_transfers") == 1
    assert count(p, "layerwise_fallback") == 0 and count(p, "staged_transfers") == 1


def test_no_chunk_is_posted_before_its_packs_completed():
    w = World()
    w.p_ops[0].hold = True
    first_chunk_reported(w)
    assert w.writes() == []
    assert not w.producers[0].busy() and w.producers[0].awaiting()  # polls, no spin
    w.p_ops[0].of("pack")[0].done = True
    w.settle()
    assert w.writes() == []  # layer 1 still packing
    w.p_ops[0].of("pack")[1].done = True
    w.settle()
    assert len(w.writes()) == 1


def test_the_transfer_thread_does_not_spin_while_waiting_for_layers():
    w = World()
    first_chunk_out(w)
    assert w.producers[0].live()["jobs"] == 1 and not w.producers[0].busy()
    assert not w.producers[0].awaiting()  # the engine's next call wakes it
    layer(w, 2)
    w.p_nodes[0].step()  # the call wakes it; layers 2-3 are not all saved yet
    assert not w.producers[0].busy() and not w.producers[0].awaiting()


def test_registration_after_the_layers_were_packed_writes_at_once():
    w = World()
    start(w)
    whole_step(w)
    assert w.writes() == [] and w.released == []
    w.expect()
    w.settle()
    assert len(w.writes()) == 2 and w.outcomes() == [Outcome("d-1", "received")]
    assert w.released == []  # prefill_done has not come
    w.prefill()
    w.settle()
    assert len(w.p_ops[0].of("pack")) == 4 and w.released == [KEY] and w.idle()


def test_registration_after_prefill_done_is_written_from_the_stream():
    w = World()
    start(w)
    for i in range(4):
        layer(w, i)
    step_end(w)
    w.prefill()
    w.settle()
    assert w.released == []  # its one unit of capacity is not claimed yet
    w.expect()
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received")] and w.released == [KEY]
    assert len(w.p_ops[0].of("pack")) == 4 and w.idle()


def test_layers_not_reported_are_packed_at_the_step_end():
    """Inside a CUDA graph vLLM calls no ``save_kv_layer``: ``step_saved`` packs them all."""
    w = World()
    w.expect()
    w.settle()
    start(w)
    layer(w, 1)
    step_end(w)
    w.settle()
    packs = w.p_ops[0].of("pack")
    assert [p.layers for p in packs] == [range(1, 2), range(0, 1), range(2, 4)]
    assert packs[1].wait_for == packs[2].wait_for == ("event-2",)
    assert w.outcomes() == [Outcome("d-1", "received")]
    w.prefill()
    w.settle()
    assert w.released == [KEY] and w.idle()


def test_without_step_saved_prefill_done_packs_the_rest_after_its_marker():
    w = World()
    w.expect()
    w.settle()
    start(w)
    layer(w, 0)
    w.prefill()  # marker "event-2"
    w.settle()
    packs = w.p_ops[0].of("pack")
    assert [(p.layers, p.wait_for) for p in packs] == [(range(0, 1), ("event-1",)),
                                                        (range(1, 4), ("event-2",))]
    assert w.outcomes() == [Outcome("d-1", "received")] and w.released == [KEY] and w.idle()


def test_a_decoder_with_a_prefix_waits_for_the_complete_prefill():
    """D has the first block (4 tokens): its slot wants tokens 4-8 only, which the stream did
    not pack on their own; the pairing is deferred to ``prefill_done`` and packed as usual."""
    w = World()
    w.expect(blocks=(3,), first_token=4)
    w.settle()
    start(w)
    whole_step(w)
    assert w.writes() == [] and w.outcomes() == []
    assert count(w.p_nodes[0], "layerwise_fallback", "layout") == 1
    w.prefill()
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received")]
    # tokens 4-8 of 4 layers, K and V, 2 heads of 16 bytes: one chunk (half a stream layer each)
    assert [(n.staged, n.num_bytes) for n in w.notices()] == [(True, 4 * 2 * 4 * 2 * 16)]
    assert w.released == [KEY] and w.idle() and w.p_pool().used_bytes == 0


def test_a_decoder_without_staging_gets_regions_after_the_prefill():
    w = World(d_pool=0)
    w.expect()
    w.settle()
    start(w)
    whole_step(w)
    assert w.writes() == []  # the region path reads the blocks: only once the prefill is done
    w.prefill()
    w.settle()
    assert w.writes() and not any(n.staged for n in w.notices())
    assert w.outcomes() == [Outcome("d-1", "received")] and w.released == [KEY] and w.idle()


def test_a_deferred_registration_cancelled_meanwhile_is_never_written():
    w = World()
    w.expect(blocks=(3,), first_token=4)
    w.settle()
    start(w)
    w.settle()
    w.cancel()
    w.settle()
    w.prefill()
    w.settle()
    assert w.writes() == []
    assert w.released == [KEY] and w.idle()


def test_no_room_for_the_stream_takes_the_post_prefill_path():
    w = World(p_pool=1024)  # too small for the 2 KiB sub-slice: regions after the prefill
    w.expect()
    w.settle()
    start(w)
    whole_step(w)
    assert w.writes() == [] and count(w.p_nodes[0], "layerwise_fallback", "producer_pool") == 1
    w.prefill()
    w.settle()
    assert not any(n.staged for n in w.notices())
    assert w.outcomes() == [Outcome("d-1", "received")] and w.released == [KEY] and w.idle()


@pytest.mark.parametrize("abandoned", ["", "prefill_aborted"])
def test_an_aborted_streamed_prefill_keeps_what_was_written_and_fails_the_rest(abandoned):
    """Three decoder requests share the prefill (fanout 3): one was written from the stream;
    another (a prefix: deferred) fails when the prefill ends aborted; the third, registering
    later, fails at once; the blocks go back to the engine once no pack runs. Both count as
    failed, or (vLLM aborted P's request) as abandoned, on both sides."""
    w = World()
    w.expect(key="d-1")
    w.expect(key="d-2", blocks=(5,), first_token=4)
    w.settle()
    start(w, capacity=3)
    w.p_ops[0].hold = True
    whole_step(w)
    packs = w.p_ops[0].of("pack")
    for p in packs[:2]:
        p.done = True  # chunk 0's layers
    w.settle()
    assert len(w.writes()) == 1
    failed(w, abandoned=abandoned)
    w.settle()
    outcomes = {o.key: o for o in w.outcomes()}
    assert outcomes["d-2"].kind == "failed" and "aborted" in outcomes["d-2"].reason
    assert w.released == []  # packs of layers 2-3 still read the blocks
    w.p_ops[0].finish()
    w.settle()
    assert len(w.writes()) == 2  # d-1's second chunk: its KV was computed when the step ran
    assert [o.kind for o in w.outcomes()] == ["received"]
    assert w.released == [KEY]
    w.expect(key="d-3", blocks=(6, 7))
    w.settle()
    (o,) = w.outcomes()
    assert o.key == "d-3" and o.kind == "failed"
    for node in (w.p_nodes[0], w.d_nodes[0]):  # d-2 (deferred, the stream's) and d-3 (spare)
        assert count(node, "transfers_abandoned", abandoned or None) == (2 if abandoned else 0)
        assert count(node, "transfers_failed") == (0 if abandoned else 2)
    w.clock.advance(200)
    w.settle()
    assert w.idle() and w.p_pool().used_bytes == 0


def test_an_aborted_request_that_was_not_streamed_is_released_at_once():
    w = World(p_pool=1024)
    start(w)  # no room: not streamed, but the scheduler held its blocks
    w.settle()
    failed(w)
    w.settle()
    assert w.released == [KEY]
    w.clock.advance(200)  # the failure waits in the rendezvous for decoders, as any does
    w.settle()
    assert w.idle()


def test_packs_still_running_hold_the_blocks_after_the_source_is_done():
    w = World(d_pool=0)  # region registration: the stream's packs are nobody's reader
    w.expect()
    w.settle()
    start(w)
    w.p_ops[0].hold = True
    for i in range(4):
        layer(w, i)
    step_end(w)
    w.prefill()
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received")]
    assert w.released == [] and w.producers[0].live()["streams"] == 1
    assert w.producers[0].busy()  # it polls the packs
    w.p_ops[0].finish()
    w.settle()
    assert w.released == [KEY] and w.idle() and w.p_pool().used_bytes == 0


def test_a_router_release_while_streaming_waits_for_the_prefill():
    w = World()
    start(w)
    layer(w, 0)
    w.settle()
    w.p_nodes[0].thread.submit(lambda: w.producers[0].release([TID]))
    w.settle()
    assert w.released == []  # the engine has not finished the request
    w.prefill()
    w.settle()
    assert w.released == [KEY] and w.idle()
    assert count(w.p_nodes[0], "release_deferred") == 1


def test_producer_tp2_streams_disjoint_sub_slices_into_one_slot():
    w = World(p_tp=2, p_kw=dict(num_kv_heads=2), d_kw=dict(num_kv_heads=2))
    w.expect()
    w.settle()
    start(w)
    for i in range(4):
        layer(w, i)
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received")]
    for r in range(2):
        assert count(w.p_nodes[r], "layerwise_transfers") == 1
    step_end(w)
    w.prefill()
    w.settle()
    assert sorted(w.released) == [KEY, KEY] and w.idle()


def test_decoder_tp2_from_producer_tp1_waits_for_the_complete_prefill():
    """Each D rank wants half the heads: not the stream's bytes (all of P's heads)."""
    w = World(d_tp=2)
    w.expect()
    w.settle()
    start(w)
    whole_step(w)
    assert w.writes() == []
    assert count(w.p_nodes[0], "layerwise_fallback", "layout") == 2
    w.prefill()
    w.settle()
    assert received(w, 0) and received(w, 1) and w.released == [KEY] and w.idle()


def test_a_decoder_dying_mid_stream_frees_everything_once_the_prefill_is_done():
    w = World()
    first_chunk_out(w)
    peer = w.p_nodes[0].thread.peers["D0"]
    w.p_nodes[0].thread.drop_peer(peer, "lifeline closed")
    w.settle()
    assert w.producers[0].live()["jobs"] == 0 and w.released == []
    layer(w, 2)
    layer(w, 3)
    step_end(w)
    w.prefill()
    w.settle()
    assert w.released == [KEY] and w.p_pool().used_bytes == 0
    assert all(v == 0 for v in w.producers[0].live().values())


def test_failed_stream_pack_fails_the_transfer():
    w = World()
    w.expect()
    w.settle()
    start(w)
    layer(w, 0)
    w.settle()
    w.p_ops[0].fail = "pack"
    layer(w, 1)
    w.settle()
    (o,) = w.outcomes()
    assert o.kind == "failed" and "packing" in o.reason
    w.p_ops[0].fail = ""
    step_end(w)
    w.prefill()
    w.settle()
    assert w.released == [KEY] and w.idle()


# -- the connector's halves ------------------------------------------------------------------------

from types import SimpleNamespace  # noqa: E402

from kv_push.common.config import PushConfig  # noqa: E402
from kv_push.common.connector_scheduler import (  # noqa: E402
    PrefillAborted, PrefillReady, PushScheduler, StepPlan,
)
from kv_push.common.connector_worker import PushConnectorWorker  # noqa: E402
from kv_push.common.connector_worker import PREFILL_ABORTED  # noqa: E402

from test_early_prefill import BS, P_PARAMS, look, new_req, output, req  # noqa: E402


def scheduler(early=False, layerwise=True):
    return PushScheduler(is_producer=True, is_decoder=False, block_size=BS,
                         early_prefill_done=early, layerwise=layerwise)


def test_the_scheduler_streams_the_prefills_its_step_completes():
    s = scheduler()
    look(s, req("whole", dict(P_PARAMS)), req("chunk", dict(P_PARAMS, transfer_id="t2")))
    plan = s.take_plan(output(new_req("whole"), new_req("chunk"), scheduled={"chunk": 64}))
    assert [p.req_id for p in plan.streaming] == ["whole"] and not plan.completing
    assert s.counters.get("prefills_streamed") == 1
    # finished normally: announced at request_finished as before (early is off), blocks held
    delay, params = s.request_finished(req("whole", dict(P_PARAMS), computed=100),
                                       list(plan.streaming[0].block_ids), finished_ok=True)
    assert (delay, params) == (True, {"transfer_id": "t1"})
    assert [p.req_id for p in s.take_plan().prefills] == ["whole"]


def test_off_streams_nothing():
    s = scheduler(layerwise=False)
    look(s, req("r", dict(P_PARAMS)))
    assert not s.take_plan(output(new_req("r"))).streaming


def test_an_aborted_streamed_request_holds_its_blocks_and_names_itself():
    """Packs may read its blocks: vLLM must keep them until the workers report the request."""
    s = scheduler()
    look(s, req("p1", dict(P_PARAMS)))
    (ready,) = s.take_plan(output(new_req("p1"))).streaming
    delay, params = s.request_finished(req("p1", dict(P_PARAMS), computed=100), [],
                                       finished_ok=False)
    assert (delay, params) == (True, None)
    (abort,) = s.take_plan().prefill_aborts
    assert abort == PrefillAborted("p1", "t1", ready.prompt_digest, 1, held=True)
    assert s.has_pending_work()
    s.on_send_finished(["p1"])
    assert not s.has_pending_work()


def test_a_streamed_request_that_lost_its_blocks_is_never_handed_over_as_good():
    s = scheduler()
    look(s, req("p1", dict(P_PARAMS)))
    (ready,) = s.take_plan(output(new_req("p1"))).streaming
    other = [b + 100 for b in ready.block_ids]
    assert s.request_finished(req("p1", dict(P_PARAMS), computed=100), other,
                              finished_ok=True) == (True, None)
    plan = s.take_plan()
    assert not plan.prefills and [a.held for a in plan.prefill_aborts] == [True]


def test_with_early_announcement_too_both_lists_name_it_once():
    s = scheduler(early=True)
    look(s, req("p1", dict(P_PARAMS)))
    plan = s.take_plan(output(new_req("p1")))
    assert [p.req_id for p in plan.completing] == [p.req_id for p in plan.streaming] == ["p1"]
    assert s.request_finished(req("p1", dict(P_PARAMS), computed=100), [], finished_ok=False) \
        == (True, {"transfer_id": "t1"})  # the early path's hold, as before
    assert not s.take_plan()  # nothing staged twice


class StubStreamingWorker:
    decoder = None
    streams = True

    def __init__(self):
        self.calls, self.producer = [], self

    def __getattr__(self, name):
        return lambda *a, **kw: self.calls.append((name, *a, *sorted(kw.items())))


def connector_worker():
    cw = PushConnectorWorker(config=PushConfig(backend="host"), role="producer", engine_id="P",
                             tp_rank=0, tp_size=1, num_kv_heads=2, head_size=8, block_size=BS,
                             dtype="bfloat16")
    cw.kv_ready_at_save = False
    cw.worker = stub = StubStreamingWorker()
    cw._layers = {"model.layers.0.attn": 0, "model.layers.1.attn": 1}
    return cw, stub


def test_the_worker_half_reports_a_streaming_steps_layers_and_its_end():
    cw, stub = connector_worker()
    cw.on_layer_saved("model.layers.0.attn")  # a step that streams nothing: no call
    cw.on_saved()
    assert stub.calls == []
    ready = PrefillReady("p1", "t1", (1, 2), 20, "dg", 2)
    cw.handle(StepPlan(streaming=[ready]))
    assert stub.calls == [("prefill_started", "p1", "t1", (1, 2), 20, ("capacity", 2),
                           ("prompt_digest", "dg"))]
    cw.on_layer_saved("model.layers.0.attn")
    cw.on_layer_saved("model.layers.1.attn")
    cw.on_layer_saved("model.embed")  # not a registered cache: ignored
    cw.on_saved()
    cw.on_layer_saved("model.layers.0.attn")  # the next step streams nothing
    assert [c[0:2] for c in stub.calls[1:]] == [("layer_saved", 0), ("layer_saved", 1),
                                                ("step_saved",)]


def test_a_held_abort_names_its_request_to_the_producer():
    cw, stub = connector_worker()
    cw.handle(StepPlan(prefill_aborts=[PrefillAborted("p1", "t1", "dg", 1, held=True),
                                       PrefillAborted("p2", "t2", "dg2", 1, aborted=True)]))
    calls = [c for c in stub.calls if c[0] == "prefill_failed"]
    assert [dict(c[3:]).get("key") for c in calls] == ["p1", None]
    # vLLM aborted p2 (its client or the router ended it): the producer counts it abandoned
    assert [c[2] for c in calls] == ["prefill request ended without output", PREFILL_ABORTED]
    assert [dict(c[3:]).get("abandoned") for c in calls] == ["", "prefill_aborted"]


def test_a_full_pool_evicts_complete_unclaimed_streams_for_a_new_one():
    """P's pool holds one stream (2 KiB of 4 KiB aligned): a second prefill takes the room of
    the first, complete and unclaimed; the first's decoder, registering later, is packed again
    from the blocks (post-prefill path)."""
    w = World(p_pool=4096)
    start(w, key="p-1", tid="t1", blocks=(0, 1))
    whole_step(w)
    w.prefill(key="p-1", tid="t1", blocks=(0, 1))
    w.settle()
    start(w, key="p-2", tid="t2", blocks=(2, 3))
    w.settle()
    p = w.p_nodes[0]
    assert count(p, "layerwise_evicted") == 1 and count(p, "layerwise_streams") == 2
    assert count(p, "layerwise_fallback", "producer_pool") == 0
    whole_step(w)
    w.prefill(key="p-2", tid="t2", blocks=(2, 3))
    w.expect(key="d-2", tid="t2", blocks=(6, 7))
    w.settle()
    assert w.outcomes() == [Outcome("d-2", "received")]
    w.expect(key="d-1", tid="t1", blocks=(4, 5))
    w.settle()
    assert w.outcomes() == [Outcome("d-1", "received")]
    assert count(p, "layerwise_transfers") == 1 and count(p, "staged_transfers") == 2
    assert sorted(w.released) == ["p-1", "p-2"] and w.idle() and w.p_pool().used_bytes == 0


def test_a_stream_being_written_is_never_evicted():
    w = World(p_pool=4096)
    w.p_nodes[0].transport.hold_writes = True
    w.expect()
    w.settle()
    start(w)
    whole_step(w)
    w.prefill()
    w.settle()
    assert w.producers[0].live()["jobs"] == 1
    start(w, key="p-2", tid="t2", blocks=(2, 3))
    w.settle()
    p = w.p_nodes[0]
    assert count(p, "layerwise_evicted") == 0
    assert count(p, "layerwise_fallback", "producer_pool") == 1
