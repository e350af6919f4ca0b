"""The upstream request form: ``kv_transfer_params`` as vLLM's ``NixlPushConnector`` reads them
(no transfer id of ours), both legs sent at once under one ``X-Request-Id``.

The transfer id is derived from each engine request's id; these tests feed the id shapes that
the vLLM versions we pin give one client request (read from their sources, the same in 0.29 and
0.32: completions ``cmpl-{X}-{prompt index}``, chat ``chatcmpl-{X}`` (``_{i}`` appended when
one chat request makes several engine requests), ``{sample}_`` in front for ``n > 1``, and a
random ``-<8 hex>`` at the end unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1``) and check
that P's and D's legs meet in the rendezvous, each decoder request with the prefill of its own
prompt.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kv_push.common.auth import TransferParamsSigner
from kv_push.common.connector_scheduler import (
    UNSIGNED_UPSTREAM,
    PushScheduler,
    TransferParams,
    TransferParamsError,
    upstream_reply,
    upstream_transfer_id,
)
from kv_push.common.metrics import Counters
from kv_push.common.rendezvous import Registration, Rendezvous, Source

BS = 16
SECRET = b"cluster-secret"

#: what a router built for vLLM's NixlPushConnector sends each leg (docs/router.md)
UP_P = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
UP_D = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "eng-p",
        "remote_request_id": None, "remote_host": "10.0.0.1", "remote_port": 5600,
        "tp_size": 1, "pp_size": 1}


def req(rid, params, prompt=None, computed=0):
    prompt = list(range(100)) if prompt is None else prompt
    return SimpleNamespace(request_id=rid, kv_transfer_params=dict(params),
                           prompt_token_ids=prompt, num_computed_tokens=computed)


# -- the transfer id from the engine request id --------------------------------------------------

# (engine request id as vLLM 0.29 and 0.32 make it, with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1)
# -> X-Request-Id; both versions append "-<8 hex>" to every id unless that variable is set
SHAPES = [
    (("cmpl-abc-0-1f2e3d4c", "cmpl-abc-0"), "abc"),  # completions, one prompt
    (("cmpl-abc-1-0a0b0c0d", "cmpl-abc-1"), "abc"),  # second prompt of a list
    (("cmpl-a-1-b-12-deadbeef", "cmpl-a-1-b-12"), "a-1-b"),  # X-Request-Id with -digits inside
    (("0_cmpl-abc-0-1f2e3d4c", "0_cmpl-abc-0"), "abc"),  # sample 0 of n = 2
    (("1_cmpl-abc-0-1f2e3d4c", "1_cmpl-abc-0"), "abc"),  # sample 1 of n = 2
    (("chatcmpl-abc-1f2e3d4c", "chatcmpl-abc"), "abc"),  # chat
    (("chatcmpl-req_7-1f2e3d4c", "chatcmpl-req_7"), "req_7"),  # chat, X ends in _digits
    (("cmpl-9b1de2c0-3a44-4b8e-b9a2-67f4c0e1d2a5-0-0123abcd",
      "cmpl-9b1de2c0-3a44-4b8e-b9a2-67f4c0e1d2a5-0"),
     "9b1de2c0-3a44-4b8e-b9a2-67f4c0e1d2a5"),  # a uuid with dashes
    # an X-Request-Id that itself ends in 8 hex digits survives where vLLM adds no suffix
    (("chatcmpl-job-cafebabe-1f2e3d4c", "chatcmpl-job-cafebabe"), "job-cafebabe"),
    (("plain-id-1f2e3d4c", "plain-id"), "plain-id"),  # another shape: used as it is
]


@pytest.mark.parametrize("ids, want", SHAPES, ids=[s[1] + "/" + s[0][1] for s in SHAPES])
@pytest.mark.parametrize("suffixed", [True, False], ids=["suffixed", "randomization-off"])
def test_the_pinned_vllm_request_ids_give_the_clients_request_id(ids, want, suffixed):
    rid = ids[0] if suffixed else ids[1]
    assert upstream_transfer_id(rid, random_suffix=suffixed) == want


def test_p_and_d_derive_one_transfer_id_from_differently_suffixed_ids():
    # the legs of one client request get independent random suffixes on P and D
    p = upstream_transfer_id("cmpl-x-0-aaaaaaaa", random_suffix=True)
    d = upstream_transfer_id("cmpl-x-0-bbbbbbbb", random_suffix=True)
    assert p == d == "x"
    # and a P with randomization off meets a D with it on
    assert upstream_transfer_id("cmpl-x-0", random_suffix=False) == d


# -- parsing --------------------------------------------------------------------------------------


def test_upstream_legs_parse_with_the_derived_transfer_id():
    p = TransferParams.parse(UP_P, request_id="cmpl-xr-0-0a1b2c3d", random_suffix=True)
    assert (p.transfer_id, p.do_remote_decode, p.do_remote_prefill, p.upstream) == (
        "xr", True, False, True)
    assert (p.remote_host, p.remote_port, p.fanout) == ("", 0, 1)
    d = TransferParams.parse(UP_D, request_id="cmpl-xr-0-99887766", random_suffix=True)
    assert (d.transfer_id, d.do_remote_prefill, d.remote_host, d.remote_port, d.upstream) == (
        "xr", True, "10.0.0.1", 5600, True)
    # the minimal legs: only what the connector needs
    assert TransferParams.parse({"do_remote_decode": True}, request_id="cmpl-xr-0") is not None
    assert TransferParams.parse({"do_remote_prefill": True, "remote_host": "h",
                                 "remote_port": "5600"}, request_id="cmpl-xr-0").remote_port == 5600
    # ours is unchanged, and says so
    ours = TransferParams.parse({"transfer_id": "t", "do_remote_decode": True},
                                request_id="cmpl-xr-0")
    assert (ours.transfer_id, ours.upstream) == ("t", False)


@pytest.mark.parametrize("raw", [
    None, {}, {"do_remote_decode": False, "do_remote_prefill": False},
    {"remote_host": "h", "remote_port": 1},
])
def test_params_naming_no_leg_are_not_a_transfer(raw):
    assert TransferParams.parse(raw, request_id="cmpl-x-0") is None


@pytest.mark.parametrize("raw, rid, error", [
    ({"do_remote_prefill": True}, "cmpl-x-0", "remote_host"),
    ({"do_remote_prefill": True, "remote_host": None, "remote_port": 5600}, "cmpl-x-0",
     "remote_host"),
    (dict(UP_D, remote_port=None), "cmpl-x-0", "remote_port"),
    (dict(UP_D, remote_port=0), "cmpl-x-0", "remote_port"),
    (dict(UP_D, do_remote_decode=True), "cmpl-x-0", "exactly one"),
    (UP_D, "cmpl--0", "names no transfer"),  # an empty X-Request-Id
    (dict(UP_D, transfer_id="t" * 257), "cmpl-x-0", "transfer_id must be .* at most 256"),
])
def test_malformed_upstream_legs_are_rejected(raw, rid, error):
    with pytest.raises(TransferParamsError, match=error) as e:
        TransferParams.parse(raw, request_id=rid)
    assert e.value.reason == "bad_transfer_params"


@pytest.mark.parametrize("rid_p, rid_d, digest", [
    ("cmpl-" + "x" * 300 + "-0-0a1b2c3d", "cmpl-" + "x" * 300 + "-0-9f8e7d6c", True),
    # the X-Request-Id fits the wire, the engine request id (D's registration) does not
    ("chatcmpl-" + "y" * 250 + "-0a1b2c3d", "chatcmpl-" + "y" * 250 + "-12345678", False),
])
def test_a_long_x_request_id_names_one_transfer_on_both_legs(rid_p, rid_d, digest):
    """An X-Request-Id too long for the wire (vLLM's prefix and suffixes push the engine
    request id past 256 characters) names the transfer by its digest, alike on both legs: the
    request keeps its KV transfer instead of being refused (it was, on D, from about 241
    characters on)."""
    p = TransferParams.parse(UP_P, request_id=rid_p, random_suffix=True)
    d = TransferParams.parse(UP_D, request_id=rid_d, random_suffix=True)
    assert p.transfer_id == d.transfer_id
    assert p.transfer_id.startswith("sha256:") == digest and len(p.transfer_id) <= 256
    # a short one is still the id itself
    assert TransferParams.parse(UP_D, request_id="cmpl-abc-0-0a1b2c3d",
                                random_suffix=True).transfer_id == "abc"
    # ours: a long engine request id is accepted (D registers under its digest)
    assert TransferParams.parse(dict(UP_D, transfer_id="t"), request_id="x" * 257) is not None


def test_a_producer_legs_remote_fields_are_ignored_not_a_crash():
    # ``int("x")`` on a producer leg's port used to escape the parser into the engine
    for raw in ({"transfer_id": "t", "do_remote_decode": True, "remote_port": "x"},
                dict(UP_P, remote_port="x", remote_host=7)):
        p = TransferParams.parse(raw, request_id="cmpl-t-0")
        assert (p.remote_host, p.remote_port) == ("", 0)


# -- the scheduler halves, then the rendezvous -------------------------------------------------


def producer(**kw):
    return PushScheduler(is_producer=True, is_decoder=False, block_size=BS,
                         random_suffix=True, **kw)


def decoder(**kw):
    return PushScheduler(is_producer=False, is_decoder=True, block_size=BS,
                         random_suffix=True, **kw)


def test_a_two_prompt_list_in_upstream_form_pairs_each_prompt_with_its_own_prefill():
    """The client sends one request with two prompts to P and to D, same X-Request-Id: each
    leg becomes two engine requests (``cmpl-X-0-...``, ``cmpl-X-1-...``). Each decoder request
    must get the prefill of its own prompt."""
    prompts = [list(range(100)), list(range(7, 107))]
    p, d = producer(), decoder()
    for i, ids in enumerate(prompts):
        r = req(f"cmpl-list-{i}-0000000{i}", UP_P, ids, computed=100)
        delay, _ = p.request_finished(r, [10 * i + k for k in range(7)], finished_ok=True)
        assert delay is True  # P holds its blocks for the push
    # D's engine requests in the other order, with suffixes of their own
    for i in (1, 0):
        r = req(f"cmpl-list-{i}-aaaaaaa{i}", UP_D, prompts[i])
        assert d.get_num_new_matched_tokens(r, 0) == (100, True)
        d.update_state_after_alloc(r, [50 + 10 * i + k for k in range(7)], 100)
    sources = p.take_plan().prefills
    expects = d.take_plan().expects
    assert {s.transfer_id for s in sources} == {e.transfer_id for e in expects} == {"list"}
    assert {(e.host, e.port) for e in expects} == {("10.0.0.1", 5600)}

    rdv = Rendezvous(ttl_s=60)
    for s in sources:
        assert rdv.add_source(Source(s.req_id, s.transfer_id, s.block_ids, s.num_tokens,
                                     s.prompt_digest, s.capacity)) == []
    paired = {}
    for e in expects:
        pairings, _ = rdv.add_registration(Registration(
            e.transfer_id, e.attempt, "d-agent", "D", 0, e.block_ids, e.first_token,
            e.num_tokens, reg_id=e.key, prompt_digest=e.prompt_digest), targets=[0])
        (pairing,) = pairings
        paired[e.key] = pairing.source.key
    assert paired == {"cmpl-list-0-aaaaaaa0": "cmpl-list-0-00000000",
                      "cmpl-list-1-aaaaaaa1": "cmpl-list-1-00000001"}


def test_upstream_producer_leg_holds_its_blocks_and_answers_as_vllms_producer_does():
    reply = upstream_reply(engine_id="eng-p", side_channel_host="10.0.0.1",
                           side_channel_port=5600, tp_size=2, pp_size=1)
    p = producer(upstream_reply=reply)
    r = req("cmpl-xr-0-0a1b2c3d", UP_P, computed=100)
    delay, params = p.request_finished(r, [1, 2, 3, 4, 5, 6, 7], finished_ok=True)
    assert delay is True
    # what routers built for vLLM's NixlPushConnector learn P's engine id and sizes from
    assert params == {"transfer_id": "xr", "do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": "eng-p", "remote_request_id": "cmpl-xr-0-0a1b2c3d",
                      "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 2,
                      "pp_size": 1, "transfer_mode": "push"}
    (ready,) = p.take_plan().prefills
    assert (ready.req_id, ready.transfer_id, ready.capacity) == ("cmpl-xr-0-0a1b2c3d", "xr", 1)
    assert p.has_pending_work()
    # a router that hands P's answer to D as it is (serially) gets a decoder leg for that prefill
    d = decoder()
    dr = req("cmpl-xr-0-99999999", params)
    assert d.get_num_new_matched_tokens(dr, 0) == (100, True)
    d.update_state_after_alloc(dr, list(range(7)), 100)
    (e,) = d.take_plan().expects
    assert (e.transfer_id, e.host, e.port, e.prompt_digest) == (
        "xr", "10.0.0.1", 5600, ready.prompt_digest)
    # ours answers as before
    ours = producer(upstream_reply=reply)
    assert ours.request_finished(req("p1", {"transfer_id": "t1", "do_remote_decode": True},
                                     computed=100), [1], finished_ok=True) == (
        True, {"transfer_id": "t1"})
    aborted = req("cmpl-xs-0-0a1b2c3d", UP_P)
    assert p.request_finished(aborted, [], finished_ok=False) == (False, None)
    (a,) = p.take_plan().prefill_aborts
    assert a.transfer_id == "xs"  # the decoder request waiting for it hears at once


def test_a_wildcard_side_channel_host_is_not_offered_to_decoders():
    reply = upstream_reply(engine_id="e", side_channel_host="0.0.0.0", side_channel_port=5600,
                           tp_size=1, pp_size=1)
    assert "remote_host" not in reply and "remote_port" not in reply
    assert reply["remote_engine_id"] == "e"


# -- with a secret ---------------------------------------------------------------------------------


def test_with_a_secret_unsigned_upstream_legs_are_served_locally_counted_and_logged_once(caplog):
    """The hardening rule: D never dials a host a client named unless the parameters are
    signed. Upstream-form parameters carry no signature: D prefills locally, P holds nothing;
    each is counted, and the log says so once (not once per request)."""
    counters = Counters()
    d = decoder(counters=counters, secret=SECRET)
    p = producer(counters=counters, secret=SECRET)
    with caplog.at_level(logging.WARNING, logger="kv_push.common.connector_scheduler"):
        for i in range(3):
            r = req(f"cmpl-u{i}-0-0a1b2c3d", dict(UP_D, remote_host="attacker.example"))
            for _ in range(2):  # asked again each step while it waits
                assert d.get_num_new_matched_tokens(r, 0) == (0, False)
            d.update_state_after_alloc(r, [], 0)
            assert d.request_finished(r, [], finished_ok=True) == (False, None)
            pr = req(f"cmpl-u{i}-0-1a1b2c3d", UP_P, computed=100)
            assert p.request_finished(pr, [1, 2, 3], finished_ok=True) == (False, None)
    assert not d.take_plan() and not p.take_plan()  # nothing sent anywhere, nothing held
    assert not p.has_pending_work()
    assert counters.get("rejected", label=UNSIGNED_UPSTREAM) == 6
    logged = [r.getMessage() for r in caplog.records if UNSIGNED_UPSTREAM in r.getMessage()]
    # once per server (D's requests end in 0a1b2c3d, P's in 1a1b2c3d), not once per request
    assert len(logged) == 2 and "0a1b2c3d" in logged[0] and "1a1b2c3d" in logged[1], logged
    assert "served without KV transfer" in logged[0]


def test_with_a_secret_an_upstream_leg_signed_over_the_derived_id_is_acted_on():
    signer = TransferParamsSigner(SECRET, 600.0, clock=lambda: 1000.0)
    d = decoder(secret=SECRET, clock=lambda: 1001.0)
    good = signer.sign(dict(UP_D, transfer_id="xr"))
    del good["transfer_id"]  # the upstream form: the id comes from X-Request-Id
    assert d.get_num_new_matched_tokens(req("cmpl-xr-0-0a1b2c3d", good), 0) == (100, True)
    # the same signature on a request of another X-Request-Id, or naming another host, fails
    for rid, raw in (("cmpl-other-0-0a1b2c3d", good),
                     ("cmpl-xr-0-0a1b2c3d", dict(good, remote_host="attacker.example"))):
        with pytest.raises(TransferParamsError) as e:
            TransferParams.parse(raw, SECRET, 1001.0, request_id=rid, random_suffix=True)
        assert e.value.reason == "bad_transfer_params_signature"


def test_the_connector_reads_whether_this_vllm_suffixes_request_ids(monkeypatch):
    from kv_push.common import vllm_compat
    from kv_push.common.connector import KVPushConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    ktc = SimpleNamespace(kv_connector_extra_config={}, kv_role="kv_consumer", engine_id="e",
                          is_kv_producer=False)
    config = SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=16))
    blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [list(range(7))],
                             get_unhashed_block_ids=lambda: list(range(7)))

    def transfer_id(rid):
        c = KVPushConnector(config, KVConnectorRole.SCHEDULER, None)
        assert c.get_num_new_matched_tokens(req(rid, UP_D), 0) == (100, True)
        c.update_state_after_alloc(req(rid, UP_D), blocks, 100)
        (e,) = c.build_connector_meta(None).plan.expects
        return e.transfer_id

    monkeypatch.delenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", raising=False)
    monkeypatch.delenv("KV_PUSH_SIDE_CHANNEL_HOST", raising=False)
    monkeypatch.delenv("KV_PUSH_SIDE_CHANNEL_PORT", raising=False)
    assert vllm_compat.request_id_random_suffix() is True  # 0.29 and 0.32 both suffix
    assert transfer_id("chatcmpl-job-cafebabe-0a1b2c3d") == "job-cafebabe"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert vllm_compat.request_id_random_suffix() is False
    assert transfer_id("chatcmpl-job-cafebabe") == "job-cafebabe"


def test_the_connectors_producer_answers_with_its_engine_id_side_channel_and_sizes(monkeypatch):
    from kv_push.common.connector import KVPushConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.request import RequestStatus

    monkeypatch.delenv("KV_PUSH_SIDE_CHANNEL_HOST", raising=False)
    monkeypatch.delenv("KV_PUSH_SIDE_CHANNEL_PORT", raising=False)
    ktc = SimpleNamespace(kv_connector_extra_config={"side_channel_host": "10.1.2.3",
                                                     "side_channel_port": 7100},
                          kv_role="kv_producer", engine_id="eng-7", is_kv_producer=True)
    config = SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=16),
                             parallel_config=SimpleNamespace(tensor_parallel_size=4,
                                                             pipeline_parallel_size=1))
    c = KVPushConnector(config, KVConnectorRole.SCHEDULER, None)
    r = req("cmpl-xr-0-0a1b2c3d", UP_P, computed=100)
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = c.request_finished(r, [1, 2, 3, 4, 5, 6, 7])
    assert delay is True
    assert {k: params[k] for k in ("transfer_id", "remote_engine_id", "remote_host",
                                   "remote_port", "tp_size", "pp_size")} == {
        "transfer_id": "xr", "remote_engine_id": "eng-7", "remote_host": "10.1.2.3",
        "remote_port": 7100, "tp_size": 4, "pp_size": 1}
