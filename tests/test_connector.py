"""The vLLM connector's scheduler half (pure bookkeeping) and its start-up validation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kv_push.common.config import ConfigError
from kv_push.common.connector_scheduler import (
    RELEASE_KEY_PREFIX,
    PushScheduler,
    TransferParams,
    TransferParamsError,
    prompt_digest,
)

BS = 16


def req(rid, params, prompt_len=100, computed=0):
    return SimpleNamespace(request_id=rid, kv_transfer_params=params,
                           prompt_token_ids=list(range(prompt_len)), num_computed_tokens=computed)


D_PARAMS = {"transfer_id": "t1", "do_remote_prefill": True, "remote_host": "10.0.0.1",
            "remote_port": 5600}
P_PARAMS = {"transfer_id": "t1", "do_remote_decode": True}


def decoder():
    return PushScheduler(is_producer=False, is_decoder=True, block_size=BS)


def producer():
    return PushScheduler(is_producer=True, is_decoder=False, block_size=BS)


@pytest.mark.parametrize("raw, error", [
    ({"transfer_id": ""}, "transfer_id"),
    ({"transfer_id": 5, "do_remote_decode": True}, "transfer_id"),
    ({"transfer_id": "t"}, "exactly one"),
    ({"transfer_id": "t", "do_remote_decode": True, "do_remote_prefill": True}, "exactly one"),
    ({"transfer_id": "t", "do_remote_prefill": True, "remote_port": 1}, "remote_host"),
    ({"transfer_id": "t", "do_remote_prefill": True, "remote_host": "h", "remote_port": "x"},
     "remote_port"),
    ({"transfer_id": "t", "do_remote_prefill": True, "remote_host": "h", "remote_port": 70000},
     "remote_port"),
])
def test_bad_transfer_params_are_rejected(raw, error):
    with pytest.raises(TransferParamsError, match=error):
        TransferParams.parse(raw)


def test_requests_without_our_params_are_not_ours():
    assert TransferParams.parse(None) is None
    # no leg of a transfer (the upstream form without a transfer id: tests/test_upstream_form.py)
    assert TransferParams.parse({"do_remote_decode": False, "do_remote_prefill": False}) is None
    s = decoder()
    assert s.get_num_new_matched_tokens(req("r", None), 0) == (0, False)


def test_malformed_params_serve_locally_and_are_counted():
    from kv_push.common.metrics import Counters

    counters = Counters()
    s = PushScheduler(is_producer=False, is_decoder=True, block_size=BS, counters=counters)
    assert s.get_num_new_matched_tokens(req("r", {"transfer_id": ""}), 0) == (0, False)
    assert counters.get("rejected", label="bad_transfer_params") == 1


def test_a_leg_for_the_other_role_is_served_locally_counted_and_logged(caplog):
    # a router with its prefill and decode servers swapped: every request is served, without
    # KV transfer, and each server says so (a walkthrough saw it pass unnoticed)
    from kv_push.common.metrics import Counters

    cd, cp = Counters(), Counters()
    d = PushScheduler(is_producer=False, is_decoder=True, block_size=BS, counters=cd)
    p = PushScheduler(is_producer=True, is_decoder=False, block_size=BS, counters=cp)
    with caplog.at_level("WARNING", logger="kv_push"):
        assert d.get_num_new_matched_tokens(req("r1", P_PARAMS), 0) == (0, False)
        assert d.request_finished(req("r1", P_PARAMS), [1, 2], finished_ok=True) == (False, None)
        assert p.get_num_new_matched_tokens(req("r2", D_PARAMS), 0) == (0, False)
        assert p.request_finished(req("r2", D_PARAMS), [1, 2], finished_ok=True) == (False, None)
        assert p.get_num_new_matched_tokens(req("r3", D_PARAMS), 0) == (0, False)
    assert not d.take_plan() and not p.take_plan()
    assert cd.get("rejected", label="wrong_role") == 1
    assert cp.get("rejected", label="wrong_role") == 2
    msgs = [r.getMessage() for r in caplog.records if "wrong_role" in r.getMessage()]
    assert len(msgs) == 2, msgs  # once per server: the rest at DEBUG
    assert "r1 is a prefill (do_remote_decode) leg" in msgs[0] and "kv_consumer" in msgs[0]
    assert "r2 is a decode (do_remote_prefill) leg" in msgs[1] and "kv_producer" in msgs[1]
    # a server with both roles takes either leg
    both = PushScheduler(is_producer=True, is_decoder=True, block_size=BS, counters=Counters())
    assert both.get_num_new_matched_tokens(req("r4", D_PARAMS), 0) == (100, True)
    assert both.counters.get("rejected", label="wrong_role") == 0


def test_decoder_claims_the_prompt_then_registers_its_new_blocks():
    s = decoder()
    r = req("r1", dict(D_PARAMS), prompt_len=100)
    assert s.get_num_new_matched_tokens(r, 32) == (68, True)  # 32 tokens from its own cache
    s.update_state_after_alloc(r, [9, 4, 7, 1, 2], 68)
    plan = s.take_plan()
    (e,) = plan.expects
    assert (e.key, e.transfer_id, e.attempt, e.host, e.port) == ("r1", "t1", 0, "10.0.0.1", 5600)
    assert e.block_ids == (9, 4, 7, 1, 2)[:5] and (e.first_token, e.num_tokens) == (32, 100)
    assert s.has_pending_work() is False  # nothing staged any more, decoder holds no P blocks
    # a second allocation call for the same request does not register again
    s.update_state_after_alloc(r, [9, 4, 7, 1, 2, 3], 68)
    assert not s.take_plan()
    # once received, a re-scheduled (preempted) request recomputes locally
    s.on_recv_finished(["r1"])
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)


def test_full_local_hit_tells_the_producer_to_release():
    s = decoder()
    r = req("r1", dict(D_PARAMS), prompt_len=64)
    s.get_num_new_matched_tokens(r, 64)
    s.update_state_after_alloc(r, [], 0)
    (e,) = s.take_plan().expects
    assert e.key == RELEASE_KEY_PREFIX + "r1" and e.block_ids == () and e.first_token == 64


def test_a_request_that_wants_prompt_logprobs_is_computed_here_and_p_let_go():
    """vLLM sets skip_reading_prefix_cache for prompt logprobs (and echo with logprobs): 0.32
    drops a connector's tokens for it, but 0.29 takes them, and its API server then died
    decoding prompt logprobs of tokens it did not compute (a router that sent such a request
    to P and D killed D). Nothing is loaded; the producer is told to let go, once."""
    s = decoder()
    r = req("r1", dict(D_PARAMS), prompt_len=100)
    r.skip_reading_prefix_cache = True
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # asked again (no blocks yet)
    s.update_state_after_alloc(r, list(range(7)), 0)
    assert s.counters.get("local_prefills", label="prompt_logprobs") == 1  # once
    (e,) = s.take_plan().expects
    assert e.key == RELEASE_KEY_PREFIX + "r1" and e.block_ids == () and e.num_tokens == 0
    assert s.request_finished(r, list(range(7)), finished_ok=True) == (False, None)
    assert not s.take_plan()  # nothing more to tell


def test_decoder_abort_while_waiting_cancels_and_abort_before_alloc_releases_p():
    s = decoder()
    r = req("r1", dict(D_PARAMS))
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, list(range(7)), 100)
    s.take_plan()
    assert s.request_finished(r, list(range(7)), finished_ok=False) == (False, None)
    assert s.take_plan().cancels == ["r1"]
    r2 = req("r2", dict(D_PARAMS, transfer_id="t2"))
    s.get_num_new_matched_tokens(r2, 0)
    s.request_finished(r2, [], finished_ok=False)  # never allocated
    (e,) = s.take_plan().expects
    assert e.key == RELEASE_KEY_PREFIX + "r2" and e.num_tokens == 0


def test_decoder_abort_before_it_was_ever_scheduled_still_releases_p():
    s = decoder()
    r = req("r3", dict(D_PARAMS, transfer_id="t3"))
    s.request_finished(r, [], finished_ok=False)  # aborted while queued: never matched
    (e,) = s.take_plan().expects
    assert e.key == RELEASE_KEY_PREFIX + "r3" and e.transfer_id == "t3" and e.block_ids == ()
    # but a request whose KV already arrived tells nobody anything when it finishes
    r4 = req("r4", dict(D_PARAMS, transfer_id="t4"))
    s.get_num_new_matched_tokens(r4, 0)
    s.update_state_after_alloc(r4, list(range(7)), 100)
    s.take_plan()
    s.on_recv_finished(["r4"])
    s.request_finished(r4, list(range(7)), finished_ok=True)
    assert not s.take_plan()


def test_decoder_rejects_a_block_list_too_short_for_the_tokens():
    s = decoder()
    r = req("r1", dict(D_PARAMS), prompt_len=100)
    s.get_num_new_matched_tokens(r, 0)
    with pytest.raises(RuntimeError, match="cannot hold"):
        s.update_state_after_alloc(r, [1, 2], 100)


def test_producer_keeps_blocks_until_sent_and_reports_aborts():
    s = producer()
    r = req("p1", dict(P_PARAMS), prompt_len=100, computed=100)
    delay, params = s.request_finished(r, [3, 5, 8, 13, 21, 34, 55], finished_ok=True)
    assert delay is True and params == {"transfer_id": "t1"}
    plan = s.take_plan()
    (p,) = plan.prefills
    assert (p.req_id, p.transfer_id, p.block_ids, p.num_tokens) == (
        "p1", "t1", (3, 5, 8, 13, 21, 34, 55), 100)
    assert s.has_pending_work()
    s.on_send_finished(["p1"])
    assert not s.has_pending_work()
    r2 = req("p2", dict(P_PARAMS, transfer_id="t2"))
    assert s.request_finished(r2, [1], finished_ok=False) == (False, None)
    (abort,) = s.take_plan().prefill_aborts
    assert (abort.req_id, abort.transfer_id, abort.capacity) == ("p2", "t2", 1)
    assert abort.prompt_digest == prompt_digest(list(range(100)))
    assert abort.aborted is False  # an error: a failure
    r3 = req("p3", dict(P_PARAMS, transfer_id="t3"))
    assert s.request_finished(r3, [1], finished_ok=False, aborted=True) == (False, None)
    assert s.take_plan().prefill_aborts[0].aborted is True  # its client or the router ended it


def test_both_halves_name_a_prompt_by_the_same_digest():
    # issue 9 item 1: a prompt list / n > 1 shares kv_transfer_params; the digest of the token ids
    # tells the prompts apart and is the same on P and D
    assert prompt_digest([1, 2, 3]) == prompt_digest((1, 2, 3)) != prompt_digest([1, 2, 4])
    assert prompt_digest([]) != prompt_digest([0]) and prompt_digest(None) == ""
    # whatever sequence type a vLLM version hands over, and pinned: the digest is wire format
    # (a change needs a new PROMPT_DIGEST_SCHEME, which changes the compatibility hash)
    import numpy as np
    from array import array
    for ids in ([1, 2, 3], (1, 2, 3), array("q", [1, 2, 3]), np.array([1, 2, 3])):
        assert prompt_digest(ids) == "30b98dbe888358fb", type(ids)
    assert prompt_digest([0, 2**40, 151000]) == "58c92a2be1a57f7f"
    p, d = producer(), decoder()
    prompts = {"a": list(range(100)), "b": list(range(1, 101))}
    for name, ids in prompts.items():
        r = req(f"p-{name}", dict(P_PARAMS), prompt_len=100, computed=100)
        r.prompt_token_ids = ids
        p.request_finished(r, [1, 2, 3, 4, 5, 6, 7], finished_ok=True)
        r = req(f"d-{name}", dict(D_PARAMS), prompt_len=100)
        r.prompt_token_ids = ids
        d.get_num_new_matched_tokens(r, 0)
        d.update_state_after_alloc(r, list(range(7)), 100)
    pre = {x.req_id: x.prompt_digest for x in p.take_plan().prefills}
    exp = {x.key: x.prompt_digest for x in d.take_plan().expects}
    assert pre["p-a"] == exp["d-a"] != pre["p-b"] == exp["d-b"]


@pytest.mark.parametrize("fanout", [0, -1, 1025, "2", 1.5, True])
def test_bad_fanout_is_rejected(fanout):
    with pytest.raises(TransferParamsError, match="fanout"):
        TransferParams.parse(dict(P_PARAMS, fanout=fanout))


def test_the_producer_legs_fanout_is_each_prefills_capacity():
    s = producer()
    r = req("p1", dict(P_PARAMS, fanout=4), computed=100)
    s.request_finished(r, [1, 2, 3, 4, 5, 6, 7], finished_ok=True)
    assert s.take_plan().prefills[0].capacity == 4
    r2 = req("p2", dict(P_PARAMS, transfer_id="t2", fanout=3))
    s.request_finished(r2, [], finished_ok=False)
    assert s.take_plan().prefill_aborts[0].capacity == 3


def test_a_decoder_request_asked_again_registers_a_new_attempt_under_its_id():
    # issue 9 item 7: the connector always sent attempt 0
    s = decoder()
    r = req("r1", dict(D_PARAMS))
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, list(range(7)), 100)
    assert [(e.key, e.attempt) for e in s.take_plan().expects] == [("r1", 0)]
    # vLLM dropped that allocation and schedules the request again
    assert s.get_num_new_matched_tokens(r, 0) == (100, True)
    s.update_state_after_alloc(r, list(range(10, 17)), 100)
    (e,) = s.take_plan().expects
    assert (e.key, e.attempt, e.block_ids) == ("r1", 1, tuple(range(10, 17)))
    # ends before its KV arrived: the (current) attempt is cancelled, not a release-only one
    s.request_finished(r, [], finished_ok=False)
    assert s.take_plan().cancels == ["r1"]


def test_a_decoder_request_asked_again_with_nothing_left_to_receive_is_abandoned():
    s = decoder()
    r = req("r1", dict(D_PARAMS), prompt_len=64)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, list(range(4)), 64)
    s.take_plan()
    assert s.get_num_new_matched_tokens(r, 64) == (0, False)  # now all cached locally
    plan = s.take_plan()
    assert plan.abandons == ["r1"] and not plan.expects and not plan.cancels
    assert s.request_finished(r, [], finished_ok=True) == (False, None)
    assert not s.take_plan()


class StubWorker:
    """What PushConnectorWorker hands work to (a PushWorker), recorded."""

    producer = None

    def __init__(self):
        self.calls, self.outcomes, self.verdicts = [], [], []
        self.waits: list[float] = []  # the timeout of each await_outcomes
        self.decoder = self

    def await_outcomes(self, timeout):
        self.waits.append(timeout)
        return bool(self.outcomes or self.verdicts)

    def expect(self, *args, **kw):
        self.calls.append(("expect", args[0], kw))

    def cancel(self, key, reason):
        self.calls.append(("cancel", key, reason))

    def drain_outcomes(self):
        out, self.outcomes = self.outcomes, []
        return out

    def drain_verdicts(self):
        out, self.verdicts = self.verdicts, []
        return out


def test_the_outcome_of_an_abandoned_request_is_not_reported_to_vllm():
    # vLLM asserts on finished_recving for a request that is running (not waiting for KV)
    from kv_push.common.config import PushConfig
    from kv_push.common.connector_scheduler import Expect, StepPlan
    from kv_push.common.connector_worker import PushConnectorWorker
    from kv_push.common.decoder import Outcome

    cw = PushConnectorWorker(config=PushConfig(backend="host"), role="decoder", engine_id="D",
                             tp_rank=0, tp_size=1, num_kv_heads=2, head_size=8, block_size=BS,
                             dtype="bfloat16")
    cw.worker = stub = StubWorker()
    cw.handle(StepPlan(expects=[Expect("r1", "t1", 0, "h", 1, (1, 2), 0, 32, "dg"),
                                Expect("r2", "t1", 0, "h", 1, (3, 4), 0, 32, "dg")]))
    cw.handle(StepPlan(abandons=["r1"]))
    assert stub.calls[0] == ("expect", "r1", {"prompt_digest": "dg"})
    assert stub.calls[-1] == ("cancel", "r1", "request re-scheduled to compute locally")
    stub.outcomes = [Outcome("r1", "released", "x"), Outcome("r2", "failed", "y")]
    assert cw.get_finished() == (set(), {"r2"}, {"r2"})
    assert cw.take_load_errors() == {3, 4}


def test_a_superseded_attempts_outcome_is_not_reported_to_vllm():
    from kv_push.common.config import PushConfig
    from kv_push.common.connector_scheduler import Expect, StepPlan
    from kv_push.common.connector_worker import PushConnectorWorker
    from kv_push.common.decoder import Outcome

    cw = PushConnectorWorker(config=PushConfig(backend="host"), role="decoder", engine_id="D",
                             tp_rank=0, tp_size=1, num_kv_heads=2, head_size=8, block_size=BS,
                             dtype="bfloat16")
    cw.worker = stub = StubWorker()
    cw.handle(StepPlan(expects=[Expect("r1", "t1", 0, "h", 1, (1, 2), 0, 32)]))
    cw.handle(StepPlan(expects=[Expect("r1", "t1", 1, "h", 1, (5, 6), 0, 32)]))
    stub.outcomes = [Outcome("r1", "received", attempt=0)]  # on its way before attempt 1
    assert cw.get_finished() == (set(), set(), set())
    stub.outcomes = [Outcome("r1", "failed", "x", attempt=1)]
    assert cw.get_finished() == (set(), {"r1"}, {"r1"})
    assert cw.take_load_errors() == {5, 6}


def _decoder_half(**kw):
    from kv_push.common.config import PushConfig
    from kv_push.common.connector_worker import PushConnectorWorker

    cw = PushConnectorWorker(config=PushConfig(backend="host"), role="decoder", engine_id="D",
                             tp_rank=0, tp_size=1, num_kv_heads=2, head_size=8, block_size=BS,
                             dtype="bfloat16", **kw)
    cw.worker = stub = StubWorker()
    return cw, stub


def test_an_idle_step_waits_for_an_outcome_only_while_kv_is_awaited():
    # idle_step_wait_s: in a step that runs no model, with KV awaited, the worker half waits
    # for an outcome (reported in that step); never in a step that runs the model, never with
    # nothing awaited, never in a call that no bind of its own step came before
    from kv_push.common.config import PushConfig
    from kv_push.common.connector_scheduler import Expect, StepPlan
    from kv_push.common.decoder import Outcome

    cw, stub = _decoder_half(idle_step_wait_s=0.004)
    cw.handle(StepPlan(idle=True))
    cw.get_finished()
    cw.handle(StepPlan(expects=[Expect("r1", "t1", 0, "h", 1, (1, 2), 0, 32)]))  # runs a model
    cw.get_finished()
    cw.handle(StepPlan(idle=True))
    cw.get_finished()
    cw.get_finished()  # no bind since: not that step's
    cw.handle(StepPlan(idle=True))
    stub.outcomes = [Outcome("r1", "received")]
    assert cw.get_finished() == (set(), {"r1"}, set())
    cw.handle(StepPlan(idle=True))  # r1 reported: nothing awaited
    cw.get_finished()
    assert stub.waits == [0.0, 0.0, 0.004, 0.0, 0.004, 0.0]
    cw.idle_step_wait_s = 0
    cw.handle(StepPlan(expects=[Expect("r2", "t2", 0, "h", 1, (3, 4), 0, 32)], idle=True))
    cw.get_finished()
    assert stub.waits[-1] == 0


def test_no_idle_step_wait_for_a_request_whose_kv_can_no_longer_arrive():
    # failed while fenced, ended by vLLM, given up: its outcome only ends a fence (a walk
    # through the review: the worker waited in every idle step for a whole fence)
    from kv_push.common.config import PushConfig
    from kv_push.common.connector_scheduler import Expect, StepPlan
    from kv_push.common.decoder import Outcome

    cw, stub = _decoder_half(idle_step_wait_s=0.004)
    cw.handle(StepPlan(expects=[Expect("r1", "t1", 0, "h", 1, (1, 2), 0, 32),
                                Expect("r2", "t2", 0, "h", 1, (3, 4), 0, 32)]))
    cw.handle(StepPlan(cancels=["r2"], idle=True))  # vLLM ended r2; r1 is awaited
    cw.get_finished()
    stub.verdicts = [Outcome("r1", "failed", "producer unresponsive")]
    cw.handle(StepPlan(idle=True))
    cw.get_finished()  # r1 reported failed: nothing awaited from here on
    cw.handle(StepPlan(idle=True))
    cw.get_finished()
    assert stub.waits == [0.004, 0.004, 0.0]


@pytest.mark.parametrize("change,role,wait", [
    ({}, "kv_consumer", 0.002),
    ({}, "kv_both", 0.002),
    ({}, "kv_producer", 0.0),
    ({"async_scheduling": True}, "kv_consumer", 0.0),
    ({"pipeline_parallel_size": 2}, "kv_consumer", 0.0),
    ({"data_parallel_size": 2}, "kv_consumer", 0.0),
    ({"extra": {"idle_step_wait_s": 0}}, "kv_consumer", 0.0),
])
def test_the_idle_step_wait_only_where_vllm_runs_one_step_at_a_time(change, role, wait):
    from kv_push.common.config import PushConfig
    from kv_push.common.connector import _idle_step_wait

    cfg = SimpleNamespace(
        scheduler_config=SimpleNamespace(async_scheduling=change.get("async_scheduling", False)),
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=change.get("pipeline_parallel_size", 1),
            data_parallel_size=change.get("data_parallel_size", 1)))
    pc = PushConfig.from_sources(change.get("extra", {}), env={})
    kv_role = {"kv_consumer": "decoder", "kv_both": "both", "kv_producer": "producer"}[role]
    assert _idle_step_wait(pc, cfg, kv_role) == wait


def test_the_scheduler_half_marks_a_step_that_runs_no_model():
    s = decoder()
    assert s.take_plan(SimpleNamespace(total_num_scheduled_tokens=0)).idle
    assert not s.take_plan(SimpleNamespace(total_num_scheduled_tokens=3)).idle
    assert not s.take_plan().idle


@pytest.mark.parametrize("failed_recving", [False, True], ids=["load_errors", "failed_recving"])
def test_a_failure_decided_while_fenced_reaches_vllm_at_once_and_frees_only_later(failed_recving):
    # a frozen producer: the request fails now (its client is answered), its blocks stay held
    # by vLLM until finished_recving says nothing can be written into them. The early report
    # is block-level (vLLM takes those before finished_recving; its failed_recving only with
    # it), on every vLLM version
    from kv_push.common.connector_scheduler import Expect, StepPlan
    from kv_push.common.decoder import Outcome

    cw, stub = _decoder_half(failed_recving=failed_recving)
    cw.handle(StepPlan(expects=[Expect("r1", "t1", 0, "h", 1, (1, 2), 0, 32),
                                Expect("r2", "t2", 0, "h", 1, (3, 4), 0, 32)]))
    stub.verdicts = [Outcome("r1", "failed", "producer P rank 0 is unresponsive")]
    assert cw.get_finished() == (set(), set(), set())  # not finished: blocks held
    assert cw.take_load_errors() == {1, 2}
    stats = cw.stats()
    assert stats["load_failures_before_fence_end"] == 1
    assert {k: v for k, v in stats.items() if k.startswith("load_failures") and "fence" not in k
            } == {"load_failures": 1, "load_failures{fail}": 1}, stats
    stub.verdicts = [Outcome("r1", "failed", "again")]  # never twice
    assert cw.get_finished() == (set(), set(), set())
    cw.handle(StepPlan(cancels=["r1"]))  # vLLM ended the request: it asks for a release
    stub.outcomes = [Outcome("r1", "released", "request finished before its KV arrived")]
    assert cw.get_finished() == (set(), {"r1"}, set())  # now vLLM frees the blocks
    assert cw.take_load_errors() == set()
    assert cw.stats() == {}  # counted once, when it was reported
    # a verdict and its outcome in one call: reported once, as an ordinary failure (with
    # finished_recving: in failed_recving where vLLM has it, else as load errors)
    stub.outcomes = [Outcome("r2", "failed", "dead")]
    stub.verdicts = [Outcome("r2", "failed", "unresponsive")]
    assert cw.get_finished() == (set(), {"r2"}, {"r2"})
    assert cw.take_load_errors() == (set() if failed_recving else {3, 4})
    assert "load_failures_before_fence_end" not in cw.stats()


def test_a_verdict_after_vllm_ended_the_request_is_neither_reported_nor_counted():
    # the client aborted while the verdict was on its way: vLLM would ignore the report
    from kv_push.common.connector_scheduler import Expect, StepPlan
    from kv_push.common.decoder import Outcome

    cw, stub = _decoder_half()
    cw.handle(StepPlan(expects=[Expect("r1", "t1", 0, "h", 1, (1, 2), 0, 32)]))
    cw.handle(StepPlan(cancels=["r1"]))
    stub.verdicts = [Outcome("r1", "failed", "producer P rank 0 is unresponsive")]
    assert cw.get_finished() == (set(), set(), set())
    assert cw.take_load_errors() == set() and cw.stats() == {}
    stub.outcomes = [Outcome("r1", "released", "request finished before its KV arrived")]
    assert cw.get_finished() == (set(), {"r1"}, set())
    assert not cw._ended and not cw._failed_early and not cw._blocks


def test_a_worker_connector_reports_early_only_with_one_kv_cache_group(monkeypatch):
    # vLLM 0.32 raises (the engine dies) on block-level load errors with several groups
    from kv_push.common import vllm_compat
    from kv_push.common.connector import KVPushConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    monkeypatch.setattr(vllm_compat, "tp_rank_and_size", lambda: (0, 1))
    monkeypatch.setattr(vllm_compat, "kv_dtype_name", lambda cfg: "bfloat16")
    ktc = SimpleNamespace(kv_connector_extra_config={"backend": "host"}, kv_role="kv_consumer",
                          engine_id="e", is_kv_producer=False, kv_load_failure_policy="fail")
    mc = SimpleNamespace(get_total_num_kv_heads=lambda: 2, get_head_size=lambda: 8,
                         get_sliding_window=lambda: None)
    cfg = SimpleNamespace(kv_transfer_config=ktc, model_config=mc,
                          cache_config=SimpleNamespace(block_size=16))
    groups = lambda n: SimpleNamespace(kv_cache_groups=[object()] * n)  # noqa: E731
    assert KVPushConnector(cfg, KVConnectorRole.WORKER, groups(1))._worker.early_failures
    assert not KVPushConnector(cfg, KVConnectorRole.WORKER, groups(2))._worker.early_failures
    assert KVPushConnector(cfg, KVConnectorRole.WORKER, None)._worker.early_failures


def test_a_verdict_vllm_no_longer_waits_for_is_dropped():
    from kv_push.common.connector_scheduler import Expect, StepPlan
    from kv_push.common.decoder import Outcome

    cw, stub = _decoder_half()
    cw.handle(StepPlan(expects=[Expect("r1", "t1", 0, "h", 1, (1, 2), 0, 32),
                                Expect("r2", "t1", 0, "h", 1, (3, 4), 0, 32)]))
    cw.handle(StepPlan(abandons=["r1"]))  # re-scheduled to compute locally
    cw.handle(StepPlan(expects=[Expect("r2", "t1", 1, "h", 1, (5, 6), 0, 32)]))  # re-allocated
    stub.verdicts = [Outcome("r1", "failed", "x"), Outcome("r2", "failed", "y", attempt=0),
                     Outcome("r9", "failed", "never expected")]
    assert cw.get_finished() == (set(), set(), set())
    assert cw.take_load_errors() == set()
    stub.verdicts = [Outcome("r2", "failed", "z", attempt=1)]
    assert cw.get_finished() == (set(), set(), set())
    assert cw.take_load_errors() == {5, 6}


def vllm_config(extra, role="kv_consumer"):
    ktc = SimpleNamespace(kv_connector_extra_config=extra, kv_role=role, engine_id="e",
                          is_kv_producer=role == "kv_producer")
    return SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=16))


def test_scheduler_half_counts_bad_params_into_vllm_stats_and_metrics():
    """The scheduler process has no transfer thread: its own counters must reach vLLM's stats
    (vLLM's scheduler adds the scheduler half's ``get_kv_connector_stats`` to the workers')."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kv_push.common.connector import KVPushConnector
    from kv_push.common.connector_stats import KVPushPromMetrics, KVPushStats
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    c = KVPushConnector(vllm_config({}), KVConnectorRole.SCHEDULER, None)
    assert c.get_kv_connector_stats() is None  # nothing counted yet
    bad = req("r", {"transfer_id": "t", "do_remote_prefill": True, "remote_port": 1})
    assert c.get_num_new_matched_tokens(bad, 0) == (0, False)  # served locally
    assert c.get_num_new_matched_tokens(bad, 0) == (0, False)  # scheduled again: not recounted
    from vllm.v1.request import RequestStatus

    bad.status = RequestStatus.FINISHED_STOPPED
    assert c.request_finished(bad, []) == (False, None)  # parses them again: still one request
    stats = c.get_kv_connector_stats()
    assert stats.data == {"rejected": 1.0, "rejected{bad_transfer_params}": 1.0}
    assert c.get_kv_connector_stats() is None  # reset once handed over
    # as vLLM does: the workers' stats of the step, plus the scheduler half's, into Prometheus
    workers = KVPushStats(data={"transfers_done": 2.0, "rejected": 1.0,
                                "rejected{unknown_peer}": 1.0})
    registry = CollectorRegistry()

    def counter(*args, **kw):
        return Counter(*args, registry=registry, **kw)

    prom = KVPushPromMetrics(vllm_config({}), {Gauge: Gauge, Counter: counter,
                                               Histogram: Histogram},
                             ["engine"], {0: ["0"]})
    prom.observe(workers.aggregate(stats).to_dict(), engine_idx=0)
    value = registry.get_sample_value
    assert value("vllm:kv_push_rejected_total", {"engine": "0",
                                                 "reason": "bad_transfer_params"}) == 1
    assert value("vllm:kv_push_rejected_total", {"engine": "0", "reason": "unknown_peer"}) == 1
    assert value("vllm:kv_push_transfers_done_total", {"engine": "0", "reason": ""}) == 2
    # the total is not exported again beside its reasons (a sum() would count it twice)
    assert value("vllm:kv_push_rejected_total", {"engine": "0", "reason": ""}) is None


def test_the_connector_tells_an_aborted_producer_request_from_a_failed_one():
    """vLLM's FINISHED_ABORTED (the HTTP request ended) makes an abandonment; an error or a
    request ignored by the engine stays a failure."""
    from kv_push.common.connector import KVPushConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import RequestStatus

    c = KVPushConnector(vllm_config({}, role="kv_producer"), KVConnectorRole.SCHEDULER, None)
    got = {}
    for status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR,
                   RequestStatus.FINISHED_IGNORED):
        r = req(status.name, dict(P_PARAMS, transfer_id=status.name))
        r.status = status
        assert c.request_finished(r, [1, 2]) == (False, None)
        got.update({a.req_id: a.aborted for a in c._scheduler.take_plan().prefill_aborts})
    assert got == {"FINISHED_ABORTED": True, "FINISHED_ERROR": False, "FINISHED_IGNORED": False}
    # a held prefill's answer names P's side channel, for the router's check of its kv=
    r = req("ok", dict(P_PARAMS, transfer_id="ok"), computed=100)
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert c.request_finished(r, [1, 2]) == (True, {"transfer_id": "ok",
                                                     "side_channel": "127.0.0.1:5600"})


def test_connector_rejects_bad_extra_config_at_start_up():
    from kv_push.common.connector import KVPushConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config = vllm_config

    c = KVPushConnector(config({"heartbeat_interval_s": 2}), KVConnectorRole.SCHEDULER, None)
    assert c.push_config.heartbeat_interval_s == 2.0
    with pytest.raises(ConfigError, match="side_chanel_port"):
        KVPushConnector(config({"side_chanel_port": 1}), KVConnectorRole.SCHEDULER, None)
    with pytest.raises(ConfigError, match="heartbeat_interval_s"):
        KVPushConnector(config({"heartbeat_interval_s": -1}), KVConnectorRole.SCHEDULER, None)
    with pytest.raises(ValueError, match="kv_role"):
        KVPushConnector(config({}, role="kv_bogus"), KVConnectorRole.SCHEDULER, None)
    for role in ("kv_producer", "kv_both"):  # a port nobody could be told
        with pytest.raises(ConfigError, match="side_channel_port 0"):
            KVPushConnector(config({"side_channel_port": 0}, role=role),
                            KVConnectorRole.SCHEDULER, None)
    c = KVPushConnector(config({"side_channel_port": 0}, role="kv_consumer"),
                        KVConnectorRole.SCHEDULER, None)  # a decoder listens on none
    assert c.push_config.side_channel_port == 0


def test_plugin_registers_the_connector_by_name_once():
    from kv_push.common import vllm_plugin
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may load plugins several times per process
    cls = KVConnectorFactory.get_connector_class_by_name("KVPushConnector")
    from kv_push.common.connector import KVPushConnector

    assert cls is KVPushConnector


# -- router-signed kv_transfer_params (with a secret) --------------------------------------------

SECRET = b"cluster-secret"


def signed(params, secret=SECRET, ttl=600.0, now=1000.0):
    from kv_push.common.auth import TransferParamsSigner

    return TransferParamsSigner(secret, ttl, clock=lambda: now).sign(params)


def test_signed_params_parse_and_every_change_breaks_the_signature():
    for raw in (signed(D_PARAMS), signed(P_PARAMS), signed({**P_PARAMS, "fanout": 3})):
        assert TransferParams.parse(raw, SECRET, now=1001.0) is not None
        # without a secret the signature is not looked at
        assert TransferParams.parse(raw) == TransferParams.parse(raw, SECRET, now=1001.0)
    d = signed(D_PARAMS)
    tampered = [
        dict(d, remote_host="attacker.example"),  # the SSRF this guards against
        dict(d, remote_port=6666),
        dict(d, transfer_id="t2"),
        dict(signed(P_PARAMS), fanout=8),  # P's blocks would wait for 8 decoder requests
        dict(d, kv_push_sig=dict(d["kv_push_sig"], expires=d["kv_push_sig"]["expires"] + 9999)),
        signed(D_PARAMS, secret=b"another-secret"),
        # a producer leg's signature pasted onto decoder parameters
        dict(D_PARAMS, kv_push_sig=signed({**P_PARAMS})["kv_push_sig"]),
    ]
    for raw in tampered:
        with pytest.raises(TransferParamsError) as e:
            TransferParams.parse(raw, SECRET, now=1001.0)
        assert e.value.reason == "bad_transfer_params_signature", raw
    for raw, reason in ((dict(D_PARAMS), "unsigned_transfer_params"),
                        (dict(P_PARAMS), "unsigned_transfer_params"),
                        (dict(d, kv_push_sig="junk"), "bad_transfer_params_signature"),
                        (dict(d, kv_push_sig={"expires": True, "mac": "00"}),
                         "bad_transfer_params_signature"),
                        (dict(d, kv_push_sig={"expires": "1", "mac": "00"}),
                         "bad_transfer_params_signature")):
        with pytest.raises(TransferParamsError) as e:
            TransferParams.parse(raw, SECRET, now=1001.0)
        assert e.value.reason == reason, raw
    # the same signature after its expiry (600 s after signing at t=1000)
    assert TransferParams.parse(d, SECRET, now=1600.0) is not None
    with pytest.raises(TransferParamsError) as e:
        TransferParams.parse(d, SECRET, now=1601.0)
    assert e.value.reason == "expired_transfer_params"


@pytest.mark.parametrize("case", ["unsigned", "forged_host", "expired"])
def test_decoder_with_secret_serves_unsigned_params_locally_and_never_dials(case, caplog):
    """A client that reaches D directly names its own host: D must not act on it."""
    from kv_push.common.metrics import Counters

    counters = Counters()
    s = PushScheduler(is_producer=False, is_decoder=True, block_size=BS, counters=counters,
                      secret=SECRET, clock=lambda: 1001.0)
    raw = {"unsigned": dict(D_PARAMS, remote_host="attacker.example"),
           "forged_host": dict(signed(D_PARAMS), remote_host="attacker.example"),
           "expired": signed(D_PARAMS, now=0.0)}[case]
    reason = {"unsigned": "unsigned_transfer_params",
              "forged_host": "bad_transfer_params_signature",
              "expired": "expired_transfer_params"}[case]
    r = req("r1", raw)
    with caplog.at_level("WARNING", logger="kv_push.common.connector_scheduler"):
        for _ in range(3):  # vLLM asks again each step while the request waits
            assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # local prefill
        s.update_state_after_alloc(r, [], 0)
        assert s.request_finished(r, [], finished_ok=False) == (False, None)
    assert not s.take_plan()  # no Expect: nothing is sent anywhere, no host is dialled
    assert counters.get("rejected", label=reason) == 1
    assert len([rec for rec in caplog.records if "r1" in rec.getMessage()]) == 1  # once
    # a signed request on the same scheduler is served with KV transfer
    good = req("r2", signed(D_PARAMS))
    assert s.get_num_new_matched_tokens(good, 0) == (100, True)
    s.update_state_after_alloc(good, list(range(7)), 100)
    (e,) = s.take_plan().expects
    assert (e.host, e.port) == ("10.0.0.1", 5600)


def test_producer_with_secret_holds_blocks_only_for_signed_params():
    from kv_push.common.metrics import Counters

    counters = Counters()
    s = PushScheduler(is_producer=True, is_decoder=False, block_size=BS, counters=counters,
                      secret=SECRET, clock=lambda: 1001.0)
    r = req("p1", dict(P_PARAMS), computed=100)
    s.get_num_new_matched_tokens(r, 0)
    assert s.request_finished(r, [1, 2, 3], finished_ok=True) == (False, None)
    assert not s.take_plan() and not s.has_pending_work()
    assert counters.get("rejected", label="unsigned_transfer_params") == 1
    ok = req("p2", signed(P_PARAMS), computed=100)
    s.get_num_new_matched_tokens(ok, 0)
    assert s.request_finished(ok, [1, 2, 3], finished_ok=True)[0] is True
    assert [p.req_id for p in s.take_plan().prefills] == ["p2"]


def test_signature_verdict_is_taken_at_the_first_look():
    """A request that queued (or ran its prefill) past the signature's expiry is still served:
    the expiry bounds when a request may arrive, not how long it may take."""
    now = [1001.0]
    s = PushScheduler(is_producer=True, is_decoder=True, block_size=BS, secret=SECRET,
                      clock=lambda: now[0])
    p = req("p1", signed(P_PARAMS), computed=100)
    d = req("d1", signed(D_PARAMS))
    s.get_num_new_matched_tokens(p, 0)
    assert s.get_num_new_matched_tokens(d, 0) == (100, True)
    now[0] = 99999.0
    assert s.get_num_new_matched_tokens(d, 0) == (100, True)
    assert s.request_finished(p, [4, 5], finished_ok=True)[0] is True
    # finished requests are forgotten: a new request with the same id is judged afresh
    assert s.get_num_new_matched_tokens(req("p1", signed(P_PARAMS)), 0) == (0, False)
    assert s.request_finished(req("p1", signed(P_PARAMS), computed=100), [4],
                              finished_ok=True) == (False, None)


def test_scheduler_half_reports_its_rejections_as_connector_stats(monkeypatch):
    from kv_push.common.connector import KVPushConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    monkeypatch.setenv("KV_PUSH_SECRET", SECRET.decode())
    monkeypatch.delenv("KV_PUSH_SECRET_FILE", raising=False)
    ktc = SimpleNamespace(kv_connector_extra_config={}, kv_role="kv_consumer", engine_id="e",
                          is_kv_producer=False)
    c = KVPushConnector(SimpleNamespace(kv_transfer_config=ktc,
                                        cache_config=SimpleNamespace(block_size=16)),
                        KVConnectorRole.SCHEDULER, None)
    assert c.get_kv_connector_stats() is None  # nothing counted yet
    assert c.get_num_new_matched_tokens(req("r", dict(D_PARAMS)), 0) == (0, False)
    stats = c.get_kv_connector_stats()
    assert stats.data == {"rejected": 1.0, "rejected{unsigned_transfer_params}": 1.0}
    assert c.get_kv_connector_stats() is None  # reset after each report
