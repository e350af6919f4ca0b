"""The router's reading of a stream's head (common/router/sse.py): output, error or end, past
vLLM's chat role chunk, whatever the chunking."""

from __future__ import annotations

import json

import pytest

from kv_push.common.router.sse import MAX_PREAMBLE_EVENTS, StreamHead, classify, error_status


def ev(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


ROLE = ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]})
ERROR = ev({"error": {"message": "Internal server error", "code": 500}})
DONE = b"data: [DONE]\n\n"
TEXT = ev({"choices": [{"index": 0, "text": "hi", "finish_reason": None}]})
CONTENT = ev({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]})


@pytest.mark.parametrize("event,kind", [
    (ROLE, "preamble"),
    (ev({"choices": [], "usage": {"prompt_tokens": 3}}), "preamble"),
    (b": keep-alive\n\n", "preamble"),
    (ERROR, "error"),
    (DONE, "done"),
    (TEXT, "output"),
    (CONTENT, "output"),
    (ev({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}), "output"),
    (ev({"choices": [{"index": 0, "delta": {"reasoning_content": "x"}}]}), "output"),
    (ev({"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "1"}]}}]}), "output"),
    (ev({"choices": [{"index": 0, "delta": {"tool_calls": []}}]}), "preamble"),
    (b"data: not json\n\n", "output"),
])
def test_classify(event: bytes, kind: str):
    assert classify(event.rstrip(b"\n")) == kind


@pytest.mark.parametrize("stream,kind", [
    (ROLE + ERROR + DONE, "error"),
    (ROLE + ROLE + CONTENT + DONE, "output"),  # n=2: one role chunk per choice
    (ROLE + DONE, "done"),
    (TEXT + ERROR, "output"),
])
@pytest.mark.parametrize("size", [1, 7, 4096])
def test_stream_head_over_any_chunking(stream: bytes, kind: str, size: int):
    head = StreamHead()
    got = None
    for i in range(0, len(stream), size):
        got = head.feed(stream[i:i + size])
        if got is not None:
            break
    assert got == kind and stream.startswith(head.data)


def test_an_unending_preamble_is_taken_as_output():
    head = StreamHead()
    fed = 0
    while head.feed(ROLE) is None:
        fed += 1
        assert fed < MAX_PREAMBLE_EVENTS
    assert head.kind == "output"


def test_a_large_role_chunk_in_pieces_is_still_preamble():
    """vLLM puts ``prompt_token_ids`` in the role chunk (``return_token_ids``): on a long prompt
    that event is large and arrives over many reads."""
    role = ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
               "prompt_token_ids": list(range(40000))})
    head = StreamHead()
    for i in range(0, len(role), 1000):
        assert head.feed(role[i:i + 1000]) is None
    assert head.feed(ERROR) == "error"


@pytest.mark.parametrize("end", [b"\r\n\r\n", b"\r\r"])
def test_other_line_ends(end: bytes):
    crlf = (ROLE + ERROR + DONE).replace(b"\n\n", end)
    head = StreamHead()
    for i in range(0, len(crlf), 3):
        if head.feed(crlf[i:i + 3]) is not None:
            break
    assert head.kind == "error"
    head = StreamHead()
    assert head.feed(ROLE.replace(b"\n\n", end) + CONTENT.replace(b"\n\n", end)) == "output"


def test_a_completion_token_without_text_yet_is_output():
    """(part of a character: vLLM streams ``text: ""``): completions have no role chunk."""
    assert classify(ev({"choices": [{"index": 0, "text": "", "finish_reason": None}]})) == "output"


def test_a_stream_that_ends_after_its_preamble_is_done():
    head = StreamHead()
    assert head.feed(ROLE) is None and head.feed(ROLE) is None
    assert head.end() == "done"
    head = StreamHead()  # cut inside an event: unreadable, so passed on as output (as before)
    assert head.feed(ROLE + ROLE[:10]) is None and head.end() == "output"


def test_an_unterminated_last_event_decides():
    head = StreamHead()
    assert head.feed(ROLE + CONTENT.rstrip(b"\n")) is None
    assert head.end() == "output"
    head = StreamHead()
    head.feed(ROLE + ERROR.rstrip(b"\n"))
    assert head.end() == "error"


@pytest.mark.parametrize("event,status", [
    (b'data: {"error": {"message": "m", "type": "BadRequestError", "code": 400}}', 400),
    (b'data: {"error": {"message": "m", "code": 500}}', 500),
    (b'data: {"error": {"message": "m"}}', None),
    (b'data: {"error": {"message": "m", "code": "400"}}', None),
    (b'data: {"error": {"message": "m", "code": true}}', None),
    (b'data: {"error": "boom"}', None),
    (b"data: [DONE]", None),
    (b"data: {not json", None),
])
def test_an_error_events_status_is_its_integer_code(event, status):
    assert error_status(event) == status


def test_the_head_keeps_the_error_events_status_also_at_the_streams_end():
    head = StreamHead()
    assert head.feed(b'data: {"error": {"message": "m", "code": 400}}\n\n') == "error"
    assert head.error_status == 400
    head = StreamHead()
    assert head.feed(b'data: {"error": {"message": "m", "code": 422}}') is None
    assert head.end() == "error" and head.error_status == 422
