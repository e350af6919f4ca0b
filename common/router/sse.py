"""Reading the head of a server-sent-events stream from vLLM: has the decode server produced
output, or did its stream open with nothing but a failure?

The router must know before it answers the client: a D leg that failed before any output is an
error the router can still report with a status (and explain, ``compat.py``), must not mark the
P/D pair as working, and leaves P's prefill to be released (nobody else frees it). vLLM's chat
stream opens with a *role chunk* (``{"delta": {"role": "assistant", "content": ""}}``) even when
the request then fails, so the first event alone does not tell; :class:`StreamHead` reads on
past such preamble events (role-only deltas, empty choices) to the first event that does:

* ``"output"``: a choice with text, content, another delta field, logprobs or a finish reason;
* ``"error"``: an ``{"error": ...}`` event (how vLLM reports a failure after a 200);
* ``"done"``: ``[DONE]`` before any output.

Anything it cannot read as JSON counts as output (it is passed on as it is, as before).
"""

from __future__ import annotations

import json

#: preamble bytes read at most before the head is taken as output (a guard, not a limit vLLM
#: comes near: its role chunk is ~200 bytes)
MAX_PREAMBLE = 64 * 1024


def sse_events(data: bytes) -> list[bytes]:
    """The complete ``data: ...`` events of an SSE body, without their blank-line ends."""
    return [e.strip() for e in data.split(b"\n\n") if e.strip()]


def classify(event: bytes) -> str:
    """One complete SSE event: ``"preamble"``, ``"output"``, ``"error"`` or ``"done"``."""
    lines = [ln for ln in event.strip().splitlines() if ln.startswith(b"data:")]
    if not lines:
        return "preamble"  # a comment or other field: carries nothing
    payload = b"\n".join(ln[5:].strip() for ln in lines)
    if payload == b"[DONE]":
        return "done"
    try:
        obj = json.loads(payload)
    except ValueError:
        return "output"
    if not isinstance(obj, dict):
        return "output"
    if "error" in obj:
        return "error"
    choices = obj.get("choices")
    if not choices:
        return "preamble"  # e.g. a usage-only chunk
    for choice in choices:
        if not isinstance(choice, dict):
            return "output"
        if choice.get("finish_reason") is not None or choice.get("text") \
                or choice.get("logprobs") is not None:
            return "output"
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(v not in (None, "", []) for k, v in delta.items()
                                           if k != "role"):
            return "output"
    return "preamble"


class StreamHead:
    """Feed a stream's bytes as they come until :attr:`kind` is set (``"output"``, ``"error"``
    or ``"done"``); :attr:`data` holds every byte fed, to be passed on unchanged."""

    def __init__(self) -> None:
        self.data = b""
        self.kind: str | None = None
        self._scanned = 0

    def feed(self, chunk: bytes) -> str | None:
        self.data += chunk
        while self.kind is None:
            end = self.data.find(b"\n\n", self._scanned)
            if end < 0:
                if len(self.data) > MAX_PREAMBLE:
                    self.kind = "output"
                break
            kind = classify(self.data[self._scanned:end])
            self._scanned = end + 2
            if kind != "preamble":
                self.kind = kind
        return self.kind
