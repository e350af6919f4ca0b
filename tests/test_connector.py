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
    assert TransferParams.parse({"do_remote_prefill": True}) is None  # e.g. vLLM's own pull
    s = decoder()
    assert s.get_num_new_matched_tokens(req("r", None), 0) == (0, False)


def test_malformed_params_serve_locally_and_are_counted():
    from kv_push.common.metrics import Counters

    counters = Counters()
    s = PushScheduler(is_producer=False, is_decoder=True, block_size=BS, counters=counters)
    assert s.get_num_new_matched_tokens(req("r", {"transfer_id": ""}), 0) == (0, False)
    assert counters.get("rejected", label="bad_transfer_params") == 1


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


def test_vllms_rejection_notice_for_a_handled_request_sends_no_second_registration():
    """vLLM's API server submits a pre-aborted copy of a request's kv_transfer_params under a
    new request id when the handler fails or is cancelled -- also when the real request reached
    the engine (a client hanging up). That copy must not register the transfer id again: on the
    decoder a second registration displaced the live want, whose CancelAck was then dropped as
    stale and its blocks stayed fenced (the e2e abort-storm leak)."""
    s = decoder()
    real = req("cmpl-t1-0-abcd", dict(D_PARAMS))
    s.get_num_new_matched_tokens(real, 0)
    s.update_state_after_alloc(real, list(range(7)), 100)
    assert [e.key for e in s.take_plan().expects] == ["cmpl-t1-0-abcd"]
    s.request_finished(real, list(range(7)), finished_ok=False)  # the client hung up
    notice = req("820969e4f141d096", dict(D_PARAMS), prompt_len=1)
    assert s.request_finished(notice, [], finished_ok=False) == (False, None)
    plan = s.take_plan()
    assert plan.cancels == ["cmpl-t1-0-abcd"] and plan.expects == []
    # the notice first, then the real request, aborted before it was ever scheduled: one release
    s.request_finished(req("5d6e7f", dict(D_PARAMS, transfer_id="t2"), prompt_len=1), [], False)
    s.request_finished(req("cmpl-t2-0-ef01", dict(D_PARAMS, transfer_id="t2")), [], False)
    (e,) = s.take_plan().expects
    assert e.key == RELEASE_KEY_PREFIX + "5d6e7f" and e.transfer_id == "t2"


def test_transfer_ids_told_are_forgotten_after_a_while():
    from kv_push.common.connector_scheduler import TOLD_TTL_S
    clock = SimpleNamespace(t=0.0)
    s = PushScheduler(is_producer=False, is_decoder=True, block_size=BS, clock=lambda: clock.t)
    s.request_finished(req("a", dict(D_PARAMS)), [], finished_ok=False)
    assert len(s.take_plan().expects) == 1
    clock.t = TOLD_TTL_S + 1  # long after any producer forgot the transfer
    s.request_finished(req("b", dict(D_PARAMS)), [], finished_ok=False)
    assert [e.key for e in s.take_plan().expects] == [RELEASE_KEY_PREFIX + "b"]


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
    assert s.take_plan().prefill_aborts == ["t2"]


def test_connector_rejects_bad_extra_config_at_start_up():
    from kv_push.common.connector import KVPushConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    def config(extra, role="kv_consumer"):
        ktc = SimpleNamespace(kv_connector_extra_config=extra, kv_role=role, engine_id="e",
                              is_kv_producer=role == "kv_producer")
        return SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=16))

    c = KVPushConnector(config({"heartbeat_interval_s": 2}), KVConnectorRole.SCHEDULER, None)
    assert c.push_config.heartbeat_interval_s == 2.0
    with pytest.raises(ConfigError, match="side_chanel_port"):
        KVPushConnector(config({"side_chanel_port": 1}), KVConnectorRole.SCHEDULER, None)
    with pytest.raises(ConfigError, match="heartbeat_interval_s"):
        KVPushConnector(config({"heartbeat_interval_s": -1}), KVConnectorRole.SCHEDULER, None)
    with pytest.raises(ValueError, match="kv_role"):
        KVPushConnector(config({}, role="kv_bogus"), KVConnectorRole.SCHEDULER, None)


def test_plugin_registers_the_connector_by_name_once():
    from kv_push.common import vllm_plugin
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may load plugins several times per process
    cls = KVConnectorFactory.get_connector_class_by_name("KVPushConnector")
    from kv_push.common.connector import KVPushConnector

    assert cls is KVPushConnector
