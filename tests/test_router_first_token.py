"""The router's first token from the prefill leg (``common/router/first_token.py``), against fake
vLLM servers that stream as vLLM does (``Behavior.tokens``): the client's stream starts with P's
token and goes on with D's without D's copy; which requests qualify; what a mismatch, a failing
D, a hang-up or an end of sequence do."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from kv_push.common.router import builds
from kv_push.common.router.first_token import (DecodeFilter, FirstTokenMismatch,
                                               PrefillAnswerHead, first_token_events,
                                               ineligible)

from test_router import CHAT, COMPLETION, all_idle, cluster, eventually, post

TOKENS = ["Hello", ",", " world", "!", " How", " are", " you"]
GREEDY = {"stream": True, "temperature": 0, "max_tokens": 5}


def events(data: bytes) -> list:
    out = []
    for raw in data.split(b"\n\n"):
        raw = raw.strip()
        if raw.startswith(b"data: "):
            payload = raw[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def text_of(evs: list, chat: bool) -> str:
    out = ""
    for e in evs:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            out += ((c.get("delta") or {}).get("content") or "") if chat else (c.get("text") or "")
    return out


def same_tokens(c, tokens=TOKENS):
    for srv in c.prefills + c.decodes:
        srv.behavior.tokens = list(tokens)


async def metric(c, path: str, reason: str | None = None) -> float:
    m = await c.metrics()
    return sum(v for (name, labels), v in m.items()
               if name == "kv_push_router_first_token_total" and dict(labels)["path"] == path
               and (reason is None or dict(labels)["reason"] == reason))


@pytest.mark.parametrize("endpoint,base,chat", [("/v1/completions", COMPLETION, False),
                                                ("/v1/chat/completions", CHAT, True)])
async def test_the_first_token_comes_from_p_and_the_rest_from_d(endpoint, base, chat):
    body = dict(base, **GREEDY)
    body.pop("max_completion_tokens", None)
    async with cluster(first_token="auto") as c:
        same_tokens(c)
        (p,), (d,) = c.prefills, c.decodes
        d.behavior.delay = 0.6  # D's first token comes long after P's
        t0 = time.monotonic()
        first_at = None
        async with c.client.stream("POST", endpoint, json=body) as r:
            assert r.status_code == 200
            data = b""
            async for chunk in r.aiter_bytes():
                if first_at is None and text_of(events(data + chunk), chat):
                    first_at = time.monotonic() - t0
                data += chunk
        evs = events(data)
        assert text_of(evs, chat) == "".join(TOKENS[:5])  # each token once, in order
        assert first_at is not None and first_at < 0.5  # P's token, before D even answered
        assert evs[-1] == "[DONE]"
        finishes = [e["choices"][0]["finish_reason"] for e in evs[:-1] if e.get("choices")]
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
        if chat:  # one role chunk, P's
            roles = [e["choices"][0]["delta"].get("role") for e in evs[:-1]]
            assert roles.count("assistant") == 1 and roles[0] == "assistant"
        (prec,), (drec,) = p.records, d.records
        assert prec.body["stream"] is True and prec.body["max_tokens"] == 1
        assert drec.body["stream"] is True and drec.body["max_tokens"] == 5
        assert await metric(c, "prefill") == 1
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_p_s_token_is_taken_without_waiting_for_the_end_of_its_answer():
    """P's answer is complete for the router at the event that ends its one choice: its usage
    chunk, [DONE] and the body's end may come later (on P's one core its transfer thread runs
    just then). D answers long before P's body ends, yet the token is P's; the rest of P's
    answer is still read to its end (the connection is reused, P's slot released)."""
    body = dict(COMPLETION, **GREEDY, stream_options={"include_usage": True})
    async with cluster(first_token="auto") as c:
        same_tokens(c)
        (p,), (d,) = c.prefills, c.decodes
        p.behavior.chunk_interval = 0.6  # P's usage chunk comes 0.6 s after its token ...
        p.behavior.linger_after_done = 0.6  # ... and its body ends 0.6 s after [DONE]
        d.behavior.delay = 0.3  # D's first bytes come at 0.3 s
        status, data, _ = await post(c, "/v1/completions", body)
        evs = events(data)
        assert status == 200 and text_of(evs, False) == "".join(TOKENS[:5])
        assert [e["usage"] for e in evs if isinstance(e, dict) and e.get("usage")] == [
            {"prompt_tokens": 3, "completion_tokens": 5}]  # D's, once
        assert await metric(c, "prefill") == 1 and await metric(c, "decode") == 0
        await eventually(lambda: all_idle(c), "P's answer read to its end, its slot free")
        (prec,) = p.records
        assert prec.completed and not prec.disconnected and b"[DONE]" in prec.sent


async def test_usage_and_max_tokens_1_as_a_single_server_streams():
    body = dict(COMPLETION, **GREEDY)
    body.update(max_tokens=1, stream_options={"include_usage": True})
    async with cluster(first_token="auto") as c:
        same_tokens(c)
        status, data, _ = await post(c, "/v1/completions", body)
        evs = events(data)
        assert status == 200 and text_of(evs, False) == TOKENS[0]
        assert [e["choices"][0]["finish_reason"] for e in evs if isinstance(e, dict)
                and e.get("choices")][-1] == "length"
        usage = [e["usage"] for e in evs if isinstance(e, dict) and e.get("usage")]
        assert usage == [{"prompt_tokens": 3, "completion_tokens": 1}]  # D's, once
        assert "stream_options" not in c.prefills[0].records[0].body


@pytest.mark.parametrize("change,reason", [
    ({"temperature": None}, "not_greedy"),
    ({"temperature": 0.7}, "not_greedy"),
    ({"n": 2}, "several_choices"),
    ({"logprobs": 1}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"stop": ["!"]}, "stop_strings"),
    ({"prompt": ["a", "b"]}, "prompt_list"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"guided_regex": "a+"}, "structured"),
    ({"response_format": {"type": "json_object"}}, "structured"),  # completions take it too
    ({"return_token_ids": True}, "token_ids"),
])
async def test_requests_that_do_not_qualify_take_the_decode_stream(change, reason):
    body = {k: v for k, v in {**COMPLETION, **GREEDY, **change}.items() if v is not None}
    async with cluster(first_token="auto") as c:
        same_tokens(c)
        c.decodes[0].behavior.delay = 0.2  # P answers first
        status, data, _ = await post(c, "/v1/completions", body)
        assert status == 200 and data == c.decodes[0].records[0].sent  # D's stream, untouched
        # (the legs go out at once, but on a loaded box P's fake may take D's 0.2 s to record
        # its leg: seen once in CI)
        await eventually(lambda: c.prefills[0].records, "P's leg to arrive")
        assert c.prefills[0].records[0].body["stream"] is False
        assert await metric(c, "decode", reason) == 1 and await metric(c, "prefill") == 0


def test_p_s_answer_is_complete_at_the_event_that_ends_its_choice():
    def ev(obj) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    role = ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None}]})
    token = ev({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "length"}]})
    usage = ev({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    head = PrefillAnswerHead()
    # fed in pieces that cut events anywhere: nothing before the token's event ends it
    whole = role + token
    kinds = [head.feed(whole[i:i + 7]) for i in range(0, len(whole), 7)]
    assert kinds[-1] == "output" and set(kinds[:-1]) == {None}
    assert head.data == whole and first_token_events(head.data, True) == \
        first_token_events(whole + usage + b"data: [DONE]\n\n", True)
    # a token event whose choice goes on (not P's one-token leg): read on to [DONE]
    going_on = ev({"choices": [{"index": 0, "text": "Hi", "finish_reason": None}]})
    head = PrefillAnswerHead()
    assert head.feed(going_on + usage) is None and head.feed(b"data: [DONE]\r\n\r\n") == "done"
    # an error, or what is no JSON, ends it too (first_token_events says why it is unusable)
    assert PrefillAnswerHead().feed(ev({"error": {"message": "x", "code": 500}})) == "error"
    assert PrefillAnswerHead().feed(b"data: {nope\n\n") == "output"


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_p_s_fingerprint_is_left_to_the_end_of_the_stream(chat):
    """vLLM stamps ``system_fingerprint`` on its stream's last event only: on P's one-token
    answer that is the token's event, which the client does not get as a last event."""
    choice = ({"index": 0, "delta": {"content": "Hi"}, "finish_reason": "length"} if chat else
              {"index": 0, "text": "Hi", "finish_reason": "length", "stop_reason": None})
    event = {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
             "choices": [choice], "system_fingerprint": "vllm-0.32.0-abc"}
    got = first_token_events(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n",
                             chat)
    assert isinstance(got, tuple) and got[1] == "Hi"
    (sent,) = events(got[0])
    assert "system_fingerprint" not in sent and sent["choices"][0]["finish_reason"] is None


def test_eligibility_rules():
    assert ineligible(dict(COMPLETION, **GREEDY), chat=False) is None
    assert ineligible(dict(CHAT, **GREEDY), chat=True) is None
    def with_(base, **kw):
        return {**base, **GREEDY, **kw}

    assert ineligible(with_(COMPLETION, prompt=[1, 2, 3]), chat=False) is None
    assert ineligible(with_(COMPLETION, prompt=["one"]), chat=False) is None
    assert ineligible(with_(COMPLETION, stream=False), chat=False) == "not_streaming"
    assert ineligible(with_(COMPLETION, temperature=True), chat=False) == "not_greedy"
    assert ineligible(with_(CHAT, logprobs=True), chat=True) == "logprobs"
    assert ineligible(with_(CHAT, tools=[{"type": "function"}]), chat=True) == "tools"
    assert ineligible(with_(CHAT, response_format={"type": "json_object"}),
                      chat=True) == "structured"
    assert ineligible(with_(COMPLETION, response_format={"type": "json_schema"}),
                      chat=False) == "structured"
    assert ineligible(with_(COMPLETION, response_format={"type": "text"}), chat=False) is None


async def test_off_the_default_never_takes_it_from_p():
    async with cluster() as c:
        same_tokens(c)
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        assert status == 200 and data == c.decodes[0].records[0].sent
        assert await metric(c, "decode", "off") == 1


async def test_a_mismatch_ends_the_stream_with_an_error_and_is_counted():
    async with cluster(first_token="auto") as c:
        same_tokens(c)
        c.decodes[0].behavior.tokens = ["Howdy"] + TOKENS[1:]
        c.decodes[0].behavior.delay = 0.3  # P answers first
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        evs = events(data)
        assert status == 200 and text_of(evs, False) == "Hello"  # P's token, then nothing of D's
        assert evs[-2]["error"]["type"] == "first_token_mismatch" and evs[-1] == "[DONE]"
        assert await metric(c, "mismatch") == 1
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_decode_failing_after_the_first_token_ends_with_an_error_event():
    async with cluster(first_token="auto") as c:
        same_tokens(c)
        c.decodes[0].behavior.fail_status = 500
        c.decodes[0].behavior.delay = 0.2
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        evs = events(data)
        assert status == 200 and text_of(evs, False) == "Hello"
        assert "error" in evs[-2] and evs[-1] == "[DONE]"
        # D produced no output: P's prefill of it is released
        sc = c.side_channels[0]
        await eventually(lambda: len(sc.releases) == 1, "P told to release the prefill")
        await eventually(lambda: all_idle(c), "router to be idle")


async def test_decode_breaking_mid_stream_after_the_first_token():
    async with cluster(first_token="auto") as c:
        same_tokens(c)
        c.decodes[0].behavior.break_after = 3
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        evs = events(data)
        assert status == 200 and text_of(evs, False) == "".join(TOKENS[:3])
        assert "error" in evs[-2] and evs[-1] == "[DONE]"


async def test_a_client_hanging_up_after_the_first_token_cancels_d():
    async with cluster(first_token="auto") as c:
        same_tokens(c)
        d = c.decodes[0]
        d.behavior.delay = 0.3
        d.behavior.chunk_interval = 0.5
        async with c.client.stream("POST", "/v1/completions",
                                   json=dict(COMPLETION, **GREEDY)) as r:
            async for chunk in r.aiter_bytes():
                if b"Hello" in chunk:
                    break  # the client leaves after P's token
        await eventually(lambda: bool(d.records) and d.records[0].disconnected,
                         "D's leg to be cancelled")
        await eventually(lambda: all_idle(c), "router to be idle")


@pytest.mark.parametrize("endpoint,base,chat", [("/v1/completions", COMPLETION, False),
                                                ("/v1/chat/completions", CHAT, True)])
async def test_a_first_token_with_empty_text_comes_from_p_as_vllm_streams_it(
        endpoint, base, chat):
    # vLLM streams a token whose bytes the detokenizer holds back as an event with empty text;
    # P's one-token answer has the same text as a longer stream's first event (module doc).
    # The client gets P's event, then D's stream without D's copy: the events and text a
    # single server streams
    first = ""
    tokens = [first, "\u00e9t\u00e9", " world", "!", " How"]
    body = dict(base, **GREEDY)
    body.pop("max_completion_tokens", None)
    async with cluster(first_token="auto") as c:
        same_tokens(c, tokens)
        c.decodes[0].behavior.delay = 0.6  # D's first token comes long after P's
        t0 = time.monotonic()
        first_at, data = None, b""
        async with c.client.stream("POST", endpoint, json=body) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_bytes():
                data += chunk
                if first_at is None and any(isinstance(e, dict) and e.get("choices") and (
                        not chat or "content" in e["choices"][0]["delta"])
                        for e in events(data)):
                    first_at = time.monotonic() - t0
        evs = events(data)
        assert first_at is not None and first_at < 0.5  # P's event, before D answered
        assert text_of(evs, chat) == "".join(tokens)
        token_events = [e for e in evs if isinstance(e, dict) and e.get("choices") and (
            not chat or not e["choices"][0]["delta"].get("role"))]
        assert len(token_events) == len(tokens)  # one per token, as a single server streams
        assert _choice(token_events[0], chat) == first
        assert await metric(c, "prefill", "empty_text") == 1
        assert await metric(c, "mismatch") == 0


def _choice(event: dict, chat: bool) -> str:
    c = event["choices"][0]
    return (c.get("delta") or {}).get("content", "") if chat else c.get("text", "")


async def test_an_empty_first_token_on_p_with_text_on_d_passes_ds_text_on():
    # nothing of P's to check D's token against, and nothing of P's in the client's text: the
    # client reads D's text (one event more than a single server: P's empty one)
    async with cluster(first_token="auto") as c:
        same_tokens(c, [""] + TOKENS[1:5])
        c.decodes[0].behavior.tokens = TOKENS[:5]
        c.decodes[0].behavior.delay = 0.3
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        assert status == 200 and text_of(events(data), False) == "".join(TOKENS[:5])
        assert await metric(c, "prefill") == 1 and await metric(c, "mismatch") == 0


async def read_builds(c) -> None:
    """Have the router read every backend's build again now (builds.py), and wait for it."""
    router = c.router
    await eventually(lambda: not router.builds.reading(), "the start-up readings")
    for b in router.prefill_pool.backends + router.decode_pool.backends:
        router.refresh_build(b, force=True)
    await eventually(lambda: not router.builds.reading(), "the readings")


PARTIAL = [["\ufffd"] + TOKENS[1:], ["a\ufffd\x1eb"] + TOKENS[1:]]


@pytest.mark.parametrize("tokens", PARTIAL, ids=["alone", "inside"])
async def test_a_partial_character_comes_from_p_where_p_and_d_run_one_build(tokens):
    async with cluster(first_token="auto") as c:
        same_tokens(c, tokens)
        c.decodes[0].behavior.delay = 0.3  # P answers first
        await read_builds(c)
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        evs = events(data)
        assert status == 200 and text_of(evs, False) == "".join(tokens[:5])
        assert _choice(evs[0], False) == tokens[0]  # P's event, then D's without its copy
        assert await metric(c, "prefill", "partial_character") == 1 and await metric(c, "mismatch") == 0


@pytest.mark.parametrize("change", [
    lambda p, d: setattr(p.behavior, "version", "0.29.0+fake"),
    lambda p, d: setattr(d.behavior, "version", None),  # D's version cannot be read
    lambda p, d: setattr(d.behavior, "model_root", "/models/other"),
], ids=["versions_differ", "version_unknown", "models_differ"])
@pytest.mark.parametrize("tokens", PARTIAL, ids=["alone", "inside"])
async def test_a_partial_character_is_left_to_d_unless_p_and_d_run_one_build(tokens, change):
    async with cluster(first_token="auto") as c:
        same_tokens(c, tokens)
        change(c.prefills[0], c.decodes[0])
        c.decodes[0].behavior.delay = 0.3  # P answers first
        await read_builds(c)
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        assert status == 200 and data == c.decodes[0].records[0].sent
        assert await metric(c, "decode", "partial_character") == 1


async def test_a_partial_character_d_holds_back_is_a_mismatch_never_hidden_nor_repeated():
    # one build by its version and models, yet D's detokenizer holds the bytes back (other
    # tokenizer settings): the client has P's U+FFFD, so the stream ends in a counted error;
    # the pair then gets no such token from P again (until a build changes)
    async with cluster(first_token="auto") as c:
        same_tokens(c, ["\ufffd"] + TOKENS[1:])
        c.decodes[0].behavior.tokens = ["", "\u00e9"] + TOKENS[2:]
        c.decodes[0].behavior.delay = 0.3  # P answers first
        await read_builds(c)
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        evs = events(data)
        assert status == 200 and text_of(evs, False) == "\ufffd"
        assert evs[-2]["error"]["type"] == "first_token_mismatch" and evs[-1] == "[DONE]"
        assert await metric(c, "mismatch") == 1
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        assert status == 200 and data == c.decodes[0].records[-1].sent
        assert await metric(c, "decode", "partial_character") == 1
        assert await metric(c, "mismatch") == 1


async def test_the_start_up_readings_alone_let_a_partial_character_come_from_p(caplog):
    caplog.set_level(logging.INFO, logger=builds.__name__)
    async with cluster(first_token="auto") as c:
        same_tokens(c, PARTIAL[0])
        c.decodes[0].behavior.delay = 0.3  # P answers first
        router = c.router
        await eventually(lambda: not router.builds.reading(), "the start-up readings")
        await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        assert await metric(c, "prefill", "partial_character") == 1
        # what each backend runs: in the log (by role) and in /health
        runs = [r.getMessage() for r in caplog.records if " runs vLLM " in r.getMessage()]
        assert sorted(m.split()[0] for m in runs) == ["decode", "prefill"], runs
        h = (await c.client.get("/health")).json()
        assert [b["build"] for b in h["prefill"] + h["decode"]] == [
            "vLLM 0.32.0+fake, models fake-model (/models/fake)"] * 2


async def test_a_stale_reading_is_taken_again_at_a_request():
    async with cluster(first_token="auto") as c:
        same_tokens(c, PARTIAL[0])
        c.decodes[0].behavior.delay = 0.3  # P answers first
        router = c.router
        await eventually(lambda: not router.builds.reading(), "the start-up readings")
        now = [time.monotonic()]
        router.builds.clock = lambda: now[0]
        c.decodes[0].behavior.version = "0.33.0+fake"  # D restarted as another version
        now[0] += builds.MAX_AGE_S + 1  # stale, still trusted: this request reads it again
        await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))  # (P's token or D's:
        # whichever comes first, the new reading or P's answer)
        await eventually(lambda: not router.builds.reading(), "the reading")
        assert router.builds.get(router.decode_pool.backends[0].url) == \
            builds.Build("0.33.0+fake", (("fake-model", "/models/fake"),))
        before = await metric(c, "decode", "partial_character")
        await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        assert await metric(c, "decode", "partial_character") == before + 1


async def test_every_decoder_a_leg_may_move_to_must_run_ps_build():
    # a D leg moves to another D when its own cannot be connected to -- possibly after P's
    # token went out: P's token must suit any of them
    async with cluster(first_token="auto", n_d=2) as c:
        same_tokens(c, PARTIAL[0])
        for d in c.decodes:
            d.behavior.delay = 0.3  # P answers first
        c.decodes[1].behavior.version = "0.29.0+fake"
        await read_builds(c)
        for _ in range(2):  # one leg to each D
            await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        assert await metric(c, "decode", "partial_character") == 2


async def test_a_decoder_whose_connection_fails_loses_its_reading():
    # it may come back as another build: what was read of it no longer counts
    async with cluster(first_token="auto", dead_decodes=1) as c:
        same_tokens(c, PARTIAL[0])
        c.decodes[0].behavior.delay = 0.3  # P answers first
        await read_builds(c)
        router = c.router
        dead = router.decode_pool.backends[0]
        build = router.builds.get(router.prefill_pool.backends[0].url)
        router.builds.record(dead.url, router.builds.begin(dead.url, force=True), build)
        assert router.builds.get(dead.url) == build  # as if it had answered before it died
        await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        assert router.builds.get(dead.url) is None and not dead.up(time.monotonic())
        assert await metric(c, "prefill", "partial_character") == 1


async def test_a_decoder_that_cannot_be_connected_to_is_forgotten():
    async with cluster(first_token="auto", dead_decodes=1) as c:
        same_tokens(c, PARTIAL[0])
        c.decodes[0].behavior.delay = 0.3  # P answers first
        await read_builds(c)  # the dead one: unknown
        dead = c.router.decode_pool.backends[0]
        assert c.router.builds.get(dead.url) is None
        # its leg moves to the live D; the dead one, now down, is not one it could move to
        await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        assert not dead.up(time.monotonic())
        assert await metric(c, "prefill", "partial_character") == 1


async def test_a_first_token_that_ends_the_sequence_on_p_is_left_to_d():
    async with cluster(first_token="auto") as c:
        same_tokens(c, TOKENS)
        for srv in c.prefills + c.decodes:
            srv.behavior.eos_at = 0
        c.decodes[0].behavior.delay = 0.3  # P answers first
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        assert status == 200 and data == c.decodes[0].records[0].sent
        assert await metric(c, "decode", "prefill_stopped") == 1


def test_the_decode_filter_splits_events_and_tokens_anywhere():
    """D's bytes may cut events anywhere, and a chunk may hold more than the first token."""
    evs = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]}
           for t in ("Hel", "lo, w", "orld")]
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in evs) + b"data: [DONE]\n\n"
    for cut in range(1, len(raw)):
        f = DecodeFilter("Hello", chat=False)
        got = f.feed(raw[:cut]) + f.feed(raw[cut:])
        assert text_of(events(got), False) == ", world" and got.endswith(b"data: [DONE]\n\n")
    with pytest.raises(FirstTokenMismatch):
        DecodeFilter("Help", chat=False).feed(raw)


@pytest.mark.parametrize("d_events", [
    # D's first token is an end of sequence (no text) where P's was "Hello"
    [{"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}],
    # D's whole answer is a prefix of P's token
    [{"choices": [{"index": 0, "text": "Hel", "finish_reason": None}]}],
    [{"choices": [{"index": 0, "text": "Hel", "finish_reason": "length"}]}],
], ids=["eos", "prefix_then_done", "prefix_then_finish"])
def test_a_decode_stream_that_ends_before_the_token_is_a_mismatch(d_events):
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in d_events)
    raw += b"data: [DONE]\n\n"
    with pytest.raises(FirstTokenMismatch):
        DecodeFilter("Hello", chat=False).feed(raw)
    # a failure of D before its first token is passed on as D's error, not a mismatch
    err = b'data: {"error": {"message": "boom", "code": 500}}\n\ndata: [DONE]\n\n'
    assert DecodeFilter("Hello", chat=False).feed(err) == err


async def test_decode_ending_with_an_end_of_sequence_where_p_did_not_is_a_mismatch():
    async with cluster(first_token="auto") as c:
        same_tokens(c)
        c.decodes[0].behavior.eos_at = 0  # D's first token ends the sequence, P's does not
        c.decodes[0].behavior.delay = 0.3  # P answers first
        status, data, _ = await post(c, "/v1/completions", dict(COMPLETION, **GREEDY))
        evs = events(data)
        assert status == 200 and text_of(evs, False) == "Hello"
        assert evs[-2]["error"]["type"] == "first_token_mismatch" and evs[-1] == "[DONE]"
        assert [e for e in evs if e == "[DONE]"] == ["[DONE]"]
        assert await metric(c, "mismatch") == 1
        await eventually(lambda: all_idle(c), "router to be idle")


@pytest.mark.parametrize("endpoint, base, chat", [("/v1/completions", COMPLETION, False),
                                                  ("/v1/chat/completions", CHAT, True)])
async def test_continuous_usage_stats_add_no_empty_event(endpoint, base, chat):
    """With ``continuous_usage_stats`` every D event carries usage: D's copy of the first
    token, emptied of its text, must not go out as an empty event because of it."""
    body = dict(base, **GREEDY, stream_options={"include_usage": True,
                                                "continuous_usage_stats": True})
    body.pop("max_completion_tokens", None)
    async with cluster(first_token="auto") as c:
        same_tokens(c)
        c.decodes[0].behavior.delay = 0.3  # P answers first
        status, data, _ = await post(c, endpoint, body)
        evs = [e for e in events(data) if isinstance(e, dict) and e.get("choices")]
        texts = [((e["choices"][0].get("delta") or {}).get("content") if chat
                  else e["choices"][0]["text"]) for e in evs]
        assert status == 200 and "".join(t or "" for t in texts) == "".join(TOKENS[:5])
        content = texts[1:] if chat else texts  # (chat: P's role chunk first)
        assert all(content), texts  # no event without text
        assert evs[-1]["usage"]["completion_tokens"] == 5
        assert await metric(c, "prefill") == 1


def _sequence(data: bytes, chat: bool) -> list:
    """What a client reads of a stream: each event's text, finish reason and usage."""
    out = []
    for e in events(data):
        if e == "[DONE]":
            out.append(e)
            continue
        c = e["choices"][0] if e.get("choices") else None
        out.append((None if c is None else (
                        ("role" if (c.get("delta") or {}).get("role") else "")
                        + (_choice(e, chat) or "")),
                    None if c is None else c.get("finish_reason"), e.get("usage"),
                    None if c is None else tuple(sorted(c))))  # the keys vLLM sets
    return out


@pytest.mark.parametrize("endpoint,base,chat", [("/v1/completions", COMPLETION, False),
                                                ("/v1/chat/completions", CHAT, True)])
@pytest.mark.parametrize("first", ["Hello", ""], ids=["text", "empty"])
@pytest.mark.parametrize("usage", [{"include_usage": True},
                                   {"include_usage": True, "continuous_usage_stats": True}],
                         ids=["usage", "continuous"])
async def test_the_client_reads_what_a_single_server_streams(endpoint, base, chat, first, usage):
    # each event's text, finish reason, usage and choice keys as one vLLM server streams them (a
    # walkthrough saw, with continuous usage, an extra event and usage counting backwards: D's
    # copy of an empty token and D's role chunk went out for their usage, P's events had none;
    # another saw P's chat chunk keep the "stop_reason" vLLM sets only on a choice's last chunk)
    tokens = [first, ",", " world", "!", " How"]
    body = dict(base, **GREEDY, stream_options=usage)
    body.pop("max_completion_tokens", None)
    async with cluster(first_token="auto") as c:
        same_tokens(c, tokens)
        c.decodes[0].behavior.delay = 0.3  # P answers first
        status, data, _ = await post(c, endpoint, body)
        assert status == 200
        single = b"".join(c.decodes[0]._vllm_stream(body, chat, "x")) + b"data: [DONE]\n\n"
        assert _sequence(data, chat) == _sequence(single, chat)
        assert await metric(c, "prefill") == 1


async def test_a_request_for_one_token_takes_ds_stream():
    # P's one token is the whole answer there: its end would have to be the client's (a
    # walkthrough saw the finish reason come in an event of its own)
    async with cluster(first_token="auto") as c:
        same_tokens(c)
        c.decodes[0].behavior.delay = 0.2
        status, data, _ = await post(c, "/v1/completions",
                                     {**COMPLETION, **GREEDY, "max_tokens": 1})
        assert status == 200 and data == c.decodes[0].records[0].sent
        assert await metric(c, "decode", "one_token") == 1
