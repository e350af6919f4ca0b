"""The test and benchmark clients' SSE line reader (``common/testing/sse_lines.py``)."""

from __future__ import annotations

import asyncio
import json

import httpx

from kv_push.common.testing.sse_lines import asse_lines, sse_lines

#: a token whose text holds characters str.splitlines (and httpx's iter_lines) splits at
ODD = "a\u2028b\x85c\x1cd\x0be"
BODY = ("data: " + json.dumps({"choices": [{"text": ODD}]}, ensure_ascii=False) + "\n\n"
        "data: [DONE]\r\n\r\n").encode()


def test_only_sse_line_ends_split_an_event_whatever_the_chunks():
    for size in (1, 2, 3, 7, len(BODY)):
        chunks = [BODY[i:i + size] for i in range(0, len(BODY), size)]
        lines = list(sse_lines(chunks))
        assert [json.loads(ln[6:])["choices"][0]["text"] for ln in lines
                if ln.startswith("data: {")] == [ODD]
        assert lines[-2:] == ["data: [DONE]", ""]
        assert list(sse_lines(chunks)) == asyncio.run(_collect(chunks))


async def _collect(chunks):
    async def gen():
        for c in chunks:
            yield c
    return [ln async for ln in asse_lines(gen())]


def test_httpx_iter_lines_would_cut_such_an_event():
    # why the clients do not use iter_lines: it splits the data line at U+2028 and friends
    lines = list(httpx.Response(200, content=BODY).iter_lines())
    assert not any(ln.startswith("data: {") and ln.endswith("}") for ln in lines)
