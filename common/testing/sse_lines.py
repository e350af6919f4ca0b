"""Reading an SSE body line by line as SSE splits it: for the benchmarks' and tests' clients.

SSE ends a line at ``\\n``, ``\\r\\n`` or ``\\r`` only; these readers split at ``\\n`` and drop a
``\\r`` before it (a bare ``\\r``, which vLLM never sends, does not end a line here).
``str.splitlines`` -- and with it httpx's ``iter_lines`` / ``aiter_lines`` -- also splits at
``\\x0b``, ``\\x0c``, ``\\x1c``-``\\x1e``, ``\\x85``, U+2028 and U+2029, which a token's text
may hold unescaped inside vLLM's JSON (the tiny random-weight model emits such tokens): the
event's ``data:`` line then arrives cut in two and does not parse (seen in the serving
benchmark, 2026-12-05: one request in 320 failed with "Unterminated string"). The router itself
reads SSE as bytes (``common/router/sse.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator


def _line(raw: bytes) -> str:
    return raw.rstrip(b"\r").decode("utf-8", errors="replace")


def _split(buf: bytes) -> tuple[list[str], bytes]:
    *lines, rest = buf.split(b"\n")
    return [_line(ln) for ln in lines], rest


def sse_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """The lines of an SSE body given as byte chunks (e.g. httpx's ``iter_bytes()``)."""
    buf = b""
    for chunk in chunks:
        lines, buf = _split(buf + chunk)
        yield from lines
    if buf:
        yield _line(buf)


async def asse_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """:func:`sse_lines` over an async iterable (e.g. httpx's ``aiter_bytes()``)."""
    buf = b""
    async for chunk in chunks:
        lines, buf = _split(buf + chunk)
        for line in lines:
            yield line
    if buf:
        yield _line(buf)
