"""Early prefill announcement (issue 12 item 4): the producer's scheduler half names, in the plan
of the step that completes a prefill, the requests whose KV that step writes
(``StepPlan.completing``); the worker half hands them to the rendezvous once that KV is in memory
(host: ``wait_for_save``; accelerators: the next bind), and ``request_finished`` then holds the
blocks without a second announcement -- whatever the request's end status."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kv_push.common.config import PushConfig
from kv_push.common.connector_scheduler import PrefillReady, PushScheduler, StepPlan, prompt_digest
from kv_push.common.connector_worker import PushConnectorWorker

BS = 16
P_PARAMS = {"transfer_id": "t1", "do_remote_decode": True}
D_PARAMS = {"transfer_id": "t1", "do_remote_prefill": True, "remote_host": "10.0.0.1",
            "remote_port": 5600}


def req(rid, params, prompt_len=100, computed=0):
    return SimpleNamespace(request_id=rid, kv_transfer_params=params,
                           prompt_token_ids=list(range(prompt_len)), num_computed_tokens=computed)


def new_req(rid, prompt_len=100, max_tokens=1, blocks=(3, 5, 8, 13, 21, 34, 55), computed=0,
            groups=None):
    """vLLM's ``NewRequestData`` as the scheduler puts it in ``SchedulerOutput``."""
    return SimpleNamespace(req_id=rid, prompt_token_ids=list(range(prompt_len)),
                           sampling_params=SimpleNamespace(max_tokens=max_tokens),
                           block_ids=groups if groups is not None else (list(blocks),),
                           num_computed_tokens=computed)


def output(*news, scheduled=None):
    """A ``SchedulerOutput``: ``news`` scheduled for their whole prompt unless ``scheduled``."""
    tokens = {n.req_id: n.prompt_token_ids and len(n.prompt_token_ids) - n.num_computed_tokens
              for n in news}
    tokens.update(scheduled or {})
    return SimpleNamespace(scheduled_new_reqs=list(news), num_scheduled_tokens=tokens)


def producer(early=True):
    return PushScheduler(is_producer=True, is_decoder=False, block_size=BS,
                         early_prefill_done=early)


def look(s, *requests):
    """vLLM asks the connector about each waiting request before it schedules it."""
    for r in requests:
        s.get_num_new_matched_tokens(r, r.num_computed_tokens)


def test_completing_names_the_p_legs_this_step_completes_and_nothing_else():
    s = producer()
    whole = req("whole", dict(P_PARAMS))
    chunk = req("chunk", dict(P_PARAMS, transfer_id="t2"))
    long_ = req("long", dict(P_PARAMS, transfer_id="t3"))
    local = req("local", None)
    hit = req("hit", dict(P_PARAMS, transfer_id="t4"), computed=96)  # a prefix hit: the rest
    absent = req("absent", dict(P_PARAMS, transfer_id="t5"))  # looked at, then not scheduled
    look(s, whole, chunk, long_, local, hit, absent)
    plan = s.take_plan(output(
        new_req("whole"), new_req("chunk"), new_req("long", max_tokens=8), new_req("local"),
        new_req("hit", computed=96), scheduled={"chunk": 64}))
    assert [(p.req_id, p.transfer_id) for p in plan.completing] == [("whole", "t1"),
                                                                     ("hit", "t4")]
    p = plan.completing[0]
    # only the blocks that hold the prompt (100 tokens: 7 of 16), the prompt's length and digest
    assert (p.block_ids, p.num_tokens, p.prompt_digest, p.capacity) == (
        (3, 5, 8, 13, 21, 34, 55), 100, prompt_digest(list(range(100))), 1)
    assert not plan.prefills and not plan.prefill_aborts
    assert s.counters.get("prefills_announced_early") == 2
    # announced once: the same request in a later output (cannot happen) is not named again
    assert not s.take_plan(output(new_req("whole"))).completing


def test_completing_is_empty_when_off_or_when_blocks_are_missing_or_in_several_groups():
    off = producer(early=False)
    look(off, req("r", dict(P_PARAMS)))
    assert not off.take_plan(output(new_req("r"))).completing
    s = producer()
    look(s, req("short", dict(P_PARAMS)), req("groups", dict(P_PARAMS, transfer_id="t2")))
    plan = s.take_plan(output(new_req("short", blocks=(1, 2, 3)),
                              new_req("groups", groups=([1, 2, 3, 4, 5, 6, 7], [9]))))
    assert not plan.completing
    # not announced early: request_finished announces them as before
    assert s.request_finished(req("short", dict(P_PARAMS), computed=100), [1, 2, 3, 4, 5, 6, 7],
                              finished_ok=True)[0] is True
    assert [p.req_id for p in s.take_plan().prefills] == ["short"]


def test_a_decoder_never_announces_prefills():
    s = PushScheduler(is_producer=False, is_decoder=True, block_size=BS, early_prefill_done=True)
    r = req("d", dict(D_PARAMS))
    look(s, r)
    assert not s.take_plan(output(new_req("d"))).completing


def test_request_finished_of_an_announced_request_holds_the_blocks_and_announces_nothing():
    s = producer()
    look(s, req("p1", dict(P_PARAMS)))
    (ready,) = s.take_plan(output(new_req("p1"))).completing
    delay, params = s.request_finished(req("p1", dict(P_PARAMS), computed=100),
                                       list(ready.block_ids), finished_ok=True)
    assert (delay, params) == (True, {"transfer_id": "t1"})
    plan = s.take_plan()
    assert not plan.prefills and not plan.prefill_aborts  # no second PrefillReady
    assert s.has_pending_work()
    s.on_send_finished(["p1"])
    assert not s.has_pending_work()


@pytest.mark.parametrize("blocks", [[3, 5, 8, 13, 21, 34, 55], []], ids=["blocks", "none"])
def test_an_announced_request_aborted_in_its_step_still_holds_its_blocks(blocks):
    """vLLM handles aborts that came while a step ran before that step's output: the request
    ends aborted, but its prefill ran and the source may be in a WRITE already. Its blocks must
    stay until the workers release the source (decoder done, router Release, time-out); no
    PrefillAborted may tell decoders it failed."""
    s = producer()
    look(s, req("p1", dict(P_PARAMS)))
    assert s.take_plan(output(new_req("p1"))).completing
    delay, _ = s.request_finished(req("p1", dict(P_PARAMS), computed=100), blocks,
                                  finished_ok=False)
    assert delay is True
    plan = s.take_plan()
    assert not plan.prefills and not plan.prefill_aborts
    assert s.has_pending_work()


def test_a_request_preempted_or_aborted_before_its_plan_is_not_announced_early():
    """vLLM builds the plan after the step's preemptions: a request preempted (or aborted while
    queued) is not in the output, is never named, and ends through request_finished as before
    (aborted: PrefillAborted; resumed later: announced at its request_finished)."""
    s = producer()
    look(s, req("pre", dict(P_PARAMS)), req("gone", dict(P_PARAMS, transfer_id="t2")))
    assert not s.take_plan(output()).completing  # neither scheduled in this step's output
    assert s.request_finished(req("gone", dict(P_PARAMS, transfer_id="t2")), [],
                              finished_ok=False) == (False, None)
    plan = s.take_plan(output())
    assert [a.req_id for a in plan.prefill_aborts] == ["gone"] and not plan.completing
    # "pre" resumed later: not a new request then, so it is announced at request_finished
    assert s.request_finished(req("pre", dict(P_PARAMS), computed=100), [4, 5, 6, 7, 8, 9, 10],
                              finished_ok=True)[0] is True
    assert [p.req_id for p in s.take_plan().prefills] == ["pre"]


# -- worker half -------------------------------------------------------------------------------

class StubProducerWorker:
    """What PushConnectorWorker hands a producer's work to (a PushWorker), recorded."""

    decoder = None

    def __init__(self):
        self.calls, self.released = [], []
        self.producer = self

    def prefill_done(self, key, transfer_id, block_ids, num_tokens, **kw):
        self.calls.append(("prefill_done", key))

    def prefill_failed(self, transfer_id, reason, **kw):
        self.calls.append(("prefill_failed", transfer_id))

    def drain_released(self):
        out, self.released = self.released, []
        return out


def worker(kv_ready_at_save):
    cw = PushConnectorWorker(config=PushConfig(backend="host"), role="producer", engine_id="P",
                             tp_rank=0, tp_size=1, num_kv_heads=2, head_size=8, block_size=BS,
                             dtype="bfloat16")
    cw.kv_ready_at_save = kv_ready_at_save
    cw.worker = stub = StubProducerWorker()
    return cw, stub


READY = PrefillReady("p1", "t1", (1, 2), 20, "dg")


def test_host_backend_announces_at_wait_for_save_and_reports_release_a_step_later():
    cw, stub = worker(kv_ready_at_save=True)
    assert cw.kv_ready_at_save is PushConnectorWorker(
        config=PushConfig(backend="host"), role="producer", engine_id="P", tp_rank=0, tp_size=1,
        num_kv_heads=2, head_size=8, block_size=BS, dtype="bfloat16").kv_ready_at_save
    cw.handle(StepPlan(completing=[READY]))
    assert stub.calls == []  # the step's forward has not run yet
    cw.on_saved()
    assert stub.calls == [("prefill_done", "p1")]
    # the WRITE was quick: released before vLLM ended the request (in this step's output)
    stub.released = ["p1"]
    assert cw.get_finished() == (set(), set(), set())
    assert cw.get_finished() == (set(), set(), set())  # asked again in the same step: still not
    cw.handle(StepPlan())  # the next step
    cw.on_saved()
    assert cw.get_finished() == ({"p1"}, set(), set())
    assert stub.calls == [("prefill_done", "p1")]  # once


def test_accelerator_backends_announce_at_the_next_bind():
    cw, stub = worker(kv_ready_at_save=False)
    cw.handle(StepPlan(completing=[READY]))
    cw.on_saved()
    assert stub.calls == []  # the device may still be writing the KV
    stub.released = []
    cw.get_finished()
    cw.handle(StepPlan())
    assert stub.calls == [("prefill_done", "p1")]
    stub.released = ["p1"]
    assert cw.get_finished() == ({"p1"}, set(), set())  # request_finished ran a step ago


# -- when the connector turns it on -------------------------------------------------------------

#: (setting, vllm_config(**kw), on): "auto" only where vLLM runs one batch at a time with full
#: attention (early announcement and layer-wise streaming alike)
ONE_BATCH_CASES = [
    ("auto", {}, True),
    ("off", {}, False),
    ("auto", {"async_scheduling": True}, False),
    ("auto", {"pp": 2}, False),
    ("auto", {"batches": 2}, False),
    ("auto", {"window": 4096}, False),
]


def vllm_config(*, async_scheduling=False, pp=1, window=None, batches=None):
    cfg = SimpleNamespace(
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
        model_config=SimpleNamespace(get_sliding_window=lambda: window))
    if batches is not None:
        cfg.max_concurrent_batches = batches
    return cfg


@pytest.mark.parametrize("setting, kw, on", ONE_BATCH_CASES)
def test_auto_turns_it_on_only_for_one_batch_at_a_time_and_full_attention(setting, kw, on):
    pytest.importorskip("vllm")
    from kv_push.common.connector import _early_prefill_done

    assert _early_prefill_done(PushConfig(early_prefill_done=setting), vllm_config(**kw)) is on


@pytest.mark.parametrize("setting, kw, on", ONE_BATCH_CASES)
def test_layerwise_streaming_needs_one_batch_at_a_time_too(setting, kw, on):
    """A stream reads a request's blocks while its step runs and WRITEs them at once: with a
    step planned before that output (async scheduling, PP) vLLM may preempt the request and
    give its blocks to a step that writes into them. The scheduler then plans no streams."""
    pytest.importorskip("vllm")
    from kv_push.common.connector import _layerwise

    cfg = vllm_config(**kw)
    assert _layerwise(PushConfig(layerwise=setting), cfg) is on
    s = PushScheduler(is_producer=True, is_decoder=False, block_size=BS,
                      layerwise=_layerwise(PushConfig(layerwise=setting), cfg))
    look(s, req("whole", dict(P_PARAMS)))
    plan = s.take_plan(output(new_req("whole")))
    assert [p.req_id for p in plan.streaming] == (["whole"] if on else [])


@pytest.mark.parametrize("early", [True, False])
def test_timing_stamps_the_output_of_the_step_that_completes_a_p_leg(monkeypatch, early):
    """``p_step_output`` (KV_PUSH_TIMING, bench_ttft_breakdown): once, when vLLM processed the
    output of the step that ran the whole prompt (P's token sampled), not of a chunk's step;
    with the early announcement on or off (off: nothing announced)."""
    from kv_push.common import timing
    stamps = []
    monkeypatch.setattr(timing, "ENABLED", True)
    monkeypatch.setattr(timing, "stamp", lambda stage, tid, **kw: stamps.append((stage, tid)))
    s = producer(early)
    look(s, req("whole", dict(P_PARAMS)), req("chunk", dict(P_PARAMS, transfer_id="t2")))
    plan = s.take_plan(output(new_req("whole"), new_req("chunk"), scheduled={"chunk": 64}))
    assert [p.req_id for p in plan.completing] == (["whole"] if early else [])
    assert ("p_step_output", "t1") not in stamps  # planned, not yet run
    s.on_step_output()
    s.on_step_output()
    assert [x for x in stamps if x[0] == "p_step_output"] == [("p_step_output", "t1")]
