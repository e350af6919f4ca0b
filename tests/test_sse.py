"""The router's reading of a stream's head (common/router/sse.py): output, error or end, past
vLLM's chat role chunk, whatever the chunking."""

from __future__ import annotations

import json

import pytest

from kv_push.common.router.sse import MAX_PREAMBLE, StreamHead, classify


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
    while head.feed(ROLE) is None:
        assert len(head.data) <= MAX_PREAMBLE + len(ROLE)
    assert head.kind == "output"


def test_a_stream_that_ends_inside_its_preamble_has_no_kind():
    head = StreamHead()
    assert head.feed(ROLE) is None and head.feed(ROLE[:10]) is None
