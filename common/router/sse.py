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
import re

#: how much preamble is read at most before the head is taken as output (a guard against a
#: stream of role-only events; vLLM sends one role chunk per choice, each a few hundred bytes,
#: more with ``return_token_ids`` on a long prompt)
MAX_PREAMBLE_EVENTS = 1024
MAX_PREAMBLE_BYTES = 64 << 20

#: an event's end: a blank line, with any of SSE's three line ends
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def sse_events(data: bytes) -> list[bytes]:
    """The complete ``data: ...`` events of an SSE body, without their blank-line ends."""
    return [e.strip() for e in _EVENT_END.split(data) if e.strip()]


def _payload(event: bytes) -> bytes | None:
    """An SSE event's data (its ``data:`` lines joined), None when it has none."""
    lines = [ln[5:].strip() for ln in event.strip().splitlines() if ln.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def error_status(event: bytes) -> int | None:
    """The ``code`` of an ``{"error": ...}`` event (vLLM's HTTP status for the failure, e.g.
    400 for a request it refused), or None."""
    try:
        err = json.loads(_payload(event) or b"").get("error")
    except (ValueError, AttributeError):
        return None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def parse_event(event: bytes) -> tuple[str | None, dict]:
    """One complete SSE event as (its kind where the data alone decides it, else None; its
    JSON object, ``{}`` unless the kind is None): ``"preamble"`` (no data: a comment or other
    field), ``"done"``, ``"error"``, or ``"output"`` for data that is no JSON object (passed
    on as it is)."""
    payload = _payload(event)
    if payload is None:
        return "preamble", {}
    if payload == b"[DONE]":
        return "done", {}
    try:
        obj = json.loads(payload)
    except ValueError:
        return "output", {}
    if not isinstance(obj, dict):
        return "output", {}
    if "error" in obj:
        return "error", {}
    return None, obj


def classify(event: bytes) -> str:
    """One complete SSE event: ``"preamble"``, ``"output"``, ``"error"`` or ``"done"``."""
    kind, obj = parse_event(event)
    if kind is not None:
        return kind
    choices = obj.get("choices")
    if not choices:
        return "preamble"  # e.g. a usage-only chunk
    for choice in choices:
        if not isinstance(choice, dict):
            return "output"
        # a completion's token event, even one with no text yet (part of a character), is
        # output: only chat streams open with a role chunk
        if "text" in choice or choice.get("finish_reason") is not None \
                or choice.get("logprobs") is not None:
            return "output"
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(v not in (None, "", []) for k, v in delta.items()
                                           if k != "role"):
            return "output"
    return "preamble"


class StreamHead:
    """Feed a stream's bytes as they come until :attr:`kind` is set (``"output"``, ``"error"``
    or ``"done"``); :attr:`data` holds every byte fed, to be passed on unchanged. When the
    stream ends first, :meth:`end` judges what is left."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.kind: str | None = None
        self._scanned = 0
        self._events = 0
        #: with kind "error": the event's ``code`` (None when it has none)
        self.error_status: int | None = None

    @property
    def data(self) -> bytes:
        return bytes(self._buf)

    def feed(self, chunk: bytes) -> str | None:
        self._buf += chunk
        while self.kind is None:
            m = _EVENT_END.search(self._buf, self._scanned)
            if m is None:
                if len(self._buf) - self._scanned > MAX_PREAMBLE_BYTES:
                    self.kind = "output"
                break
            kind = self._judge(bytes(self._buf[self._scanned:m.start()]))
            self._scanned = m.end()
            self._events += 1
            if kind != "preamble":
                self.kind = kind
            elif self._events >= MAX_PREAMBLE_EVENTS:
                self.kind = "output"
        return self.kind

    def end(self) -> str:
        """The stream ended before :attr:`kind` was set: its last, unterminated event decides
        (output stays output); nothing but preamble is ``"done"``."""
        if self.kind is None:
            rest = bytes(self._buf[self._scanned:]).strip()
            kind = self._judge(rest) if rest else "done"
            self.kind = "done" if kind == "preamble" else kind
        return self.kind

    def _judge(self, event: bytes) -> str:
        """``classify``, noting an error event's status."""
        kind = classify(event)
        if kind == "error":
            self.error_status = error_status(event)
        return kind
