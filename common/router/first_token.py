"""The first token from the prefill leg (push mode, streaming requests).

P's leg asks for one token; P samples it at the end of the prefill, long before D -- which
waits for the KV, schedules the request and runs one step -- samples the same token again. For a
streaming client the router can send P's token at once and then D's stream without D's copy of
it. That is only right where P's token *is* D's first token, so it is done only for requests
where both legs provably pick the same one (:func:`ineligible`):

* greedy sampling (``temperature`` given as 0; an absent temperature is the model's default,
  which may sample), one choice (``n`` 1, no ``best_of``, no beam search, one prompt);
* nothing that makes the streamed first token differ from a lone one: no logprobs or token ids
  in the output (P's would have to be merged), no echo, no stop strings (a stream holds back
  text that may begin one), no ``min_tokens`` (P's leg cannot carry it), no structured output
  or tools (other delta fields).

P's leg is then streamed (one token, with the client's ``stream_options``);
:func:`first_token_events` turns its events into what the client gets first -- P's own chunks,
with ``finish_reason`` cleared (P stopped at its one token; the client's request goes on) and
their usage as a single server's first chunks carry it (``continuous_usage_stats``), P's
usage-only chunk and ``[DONE]`` left out -- and refuses when P stopped there (an end of
sequence: D says how the request ends). A request for one token is not eligible: P's token would
be its whole answer. :class:`DecodeFilter` then
passes D's stream on, minus its copy of that token (and, for chat, D's role chunk): D's text
must begin with P's, which it does unless the two servers' logits differ (different
numerics); a mismatch is never hidden -- the stream ends with an error event and ``[DONE]``,
and the router counts it (``kv_push_router_first_token_total{path="mismatch"}``).

A token's text may be empty (the detokenizer holds back the bytes of a character the next
token completes; a special token). vLLM streams such a first token as an event with empty text
(it carries a token), and P's one-token answer has the same text as a longer stream's first
event (vLLM 0.32, tiny model: 40 of 40 prompts alike, 6 of them empty; P's detokenizer does not
flush at the end of its one token). So P's event goes to the client as a single server's first
event would, also when empty, and D's copy of it -- an event whose text is all P's, or empty
where P's was -- is left out. An empty P text leaves nothing to check D's token against, and
nothing of P's in the client's text: the client reads D's text alone (counted as
``first_token_total{path="prefill", reason="empty_text"}``: no visible text came sooner). A
text with replacement characters (bytes that are no valid UTF-8; 10 of those 40) matched D's in
every case seen, but a P and D whose detokenizers differ (other vLLM versions or tokenizer
settings) would end such streams in a mismatch: it is taken from P only where the router knows
that P and D run the same build (``builds.py``: the same ``/version`` and models), and left to D
otherwise (``partial_character``).
"""

from __future__ import annotations

import json
from typing import Any

from kv_push.common.router.sse import StreamHead, parse_event, sse_events

#: request keys that change what a streamed token looks like, or may make P's leg pick another
#: token than D's first, with the fallback reason they are counted under
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs", "guided_decoding_backend")


class FirstTokenMismatch(Exception):
    """D's first token's text is not P's."""


def ineligible(body: dict, chat: bool) -> str | None:
    """Why ``body`` cannot take the first token from P (a short reason), or None when it can."""
    if body.get("stream") is not True:
        return "not_streaming"
    t = body.get("temperature")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t != 0:
        return "not_greedy"
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1) \
            or body.get("use_beam_search"):
        return "several_choices"
    if chat:
        if body.get("logprobs") or body.get("top_logprobs") is not None:
            return "logprobs"
        if body.get("tools") or body.get("tool_choice") not in (None, "none") \
                or body.get("functions"):
            return "tools"
        if body.get("continue_final_message") or body.get("echo"):
            return "echo"
    else:
        if body.get("logprobs") is not None:
            return "logprobs"
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(x, int) for x in prompt) \
                and len(prompt) != 1:
            return "prompt_list"
        if body.get("echo"):
            return "echo"
    if body.get("prompt_logprobs") is not None:
        return "logprobs"
    if body.get("return_token_ids"):
        return "token_ids"
    if body.get("stop"):
        return "stop_strings"
    if body.get("min_tokens"):
        return "min_tokens"
    if 1 in (body.get("max_tokens"), body.get("max_completion_tokens")):
        # P's one token is the whole answer: its end would have to be the client's
        return "one_token"
    if any(body.get(k) is not None for k in _STRUCTURED):
        return "structured"
    # (vLLM takes response_format on completions too: json_object, json_schema)
    if body.get("response_format") not in (None, {"type": "text"}):
        return "structured"
    return None


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _choice_text(choice: dict, chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def first_token_events(p_body: bytes, chat: bool, replacement_ok: bool = False
                       ) -> tuple[bytes, str] | str:
    """From P's streamed one-token answer: (the SSE bytes the client gets first, the token's
    text), or why it cannot be used (a short reason). ``replacement_ok``: P and D are known to
    run the same build, so a text with replacement characters may be used."""
    out: list[bytes] = []
    text = ""
    kept_token = False  # an event of the token is in ``out`` (one is, even with empty text)
    for raw in sse_events(p_body):
        if not raw.startswith(b"data:"):
            continue
        payload = raw[5:].strip()
        if payload == b"[DONE]":
            break
        try:
            obj = json.loads(payload)
        except ValueError:
            return "prefill_unreadable"
        if not isinstance(obj, dict) or "error" in obj:
            return "prefill_error"
        choices = obj.get("choices") or []
        if not choices:
            continue  # P's usage chunk: the client's usage comes from D
        if len(choices) != 1 or not isinstance(choices[0], dict):
            return "prefill_unexpected"
        choice = choices[0]
        if chat:
            delta = choice.get("delta") or {}
            extra = {k for k, v in delta.items() if v not in (None, "")} - {"role", "content"}
            if extra:
                return "delta_fields"
            token = not delta.get("role")  # vLLM's role chunk comes before any token
            keep = bool(delta.get("role")) or bool(delta.get("content")) or (
                token and not kept_token)
        else:
            token = True
            keep = bool(choice.get("text")) or not kept_token
        kept_token = kept_token or (keep and token)
        text += _choice_text(choice, chat)
        if choice.get("finish_reason") not in (None, "length"):
            return "prefill_stopped"  # an end of sequence or a stop: D says how it ends
        choice["finish_reason"] = None
        # vLLM stamps its fingerprint on the stream's last event (the one that ends the
        # choice, or the usage chunk after it): P's token event is not the client's last
        obj.pop("system_fingerprint", None)
        if chat:  # vLLM sets a chat choice's stop_reason on its last chunk only
            choice.pop("stop_reason", None)
        elif "stop_reason" in choice:  # a completion's chunks all carry it
            choice["stop_reason"] = None
        if keep:  # (with continuous usage stats its usage is a single server's for that event)
            out.append(_event(obj))
    if not kept_token:
        return "prefill_unexpected"  # no event of a token at all
    if "\ufffd" in text and not replacement_ok:
        # invalid bytes: P and D show them alike where both run one vLLM and tokenizer setup,
        # but a detokenizer that holds them back on one side would end the stream in a
        # mismatch; a token with no text at all cannot mismatch
        return "partial_character"
    return b"".join(out), text


class PrefillAnswerHead(StreamHead):
    """P's streamed one-token answer, fed as it comes (``feed``, as :class:`StreamHead`) until
    it holds what :func:`first_token_events` reads: the event that ends P's one choice (it
    carries a ``finish_reason``: P stops at its one token), an error event, or ``[DONE]``.
    What may follow -- P's usage-only chunk, ``[DONE]``, the end of the body -- changes nothing
    that function returns, so the router need not wait for it: on P's one core the transfer
    thread's work for the same request runs just then, and delays the rest of P's answer."""

    def _judge(self, event: bytes) -> str:
        kind, obj = parse_event(event)  # (what is no JSON object ends it as "output":
        if kind is not None:  # first_token_events says why it cannot be used)
            return kind
        choices = obj.get("choices")
        if isinstance(choices, list) and any(
                isinstance(c, dict) and c.get("finish_reason") is not None for c in choices):
            return "output"
        return "preamble"  # a role chunk, a token event P's choice goes on after (not with
        # max_tokens 1), a usage chunk


class DecodeFilter:
    """D's SSE stream minus its copy of the first token (see the module doc). ``feed`` takes
    bytes as they come and returns the bytes to send on; raises :class:`FirstTokenMismatch`."""

    def __init__(self, first_text: str, chat: bool):
        self.remaining = first_text
        self.chat = chat
        self._buf = b""
        self.done = False

    def feed(self, data: bytes) -> bytes:
        if self.done:
            return data
        self._buf += data
        out = []
        while not self.done:
            end = self._buf.find(b"\n\n")
            if end < 0:
                break
            raw, self._buf = self._buf[:end], self._buf[end + 2:]
            out.append(self._one(raw))
        if self.done:
            out.append(self._buf)
            self._buf = b""
        return b"".join(out)

    def _one(self, raw: bytes) -> bytes:
        stripped = raw.strip()
        if not stripped:
            return b""
        payload = stripped[5:].strip() if stripped.startswith(b"data:") else b""
        try:
            obj: Any = json.loads(payload) if payload and payload != b"[DONE]" else None
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not obj.get("choices"):
            if isinstance(obj, dict) and "error" in obj:
                self.done = True  # D failed before its first token: pass its error on
            elif payload == b"[DONE]":  # D's whole answer is a prefix of P's token: not it
                raise FirstTokenMismatch(f"the decode server's stream ended before "
                                         f"{self.remaining!r} of the prefill server's token")
            return raw + b"\n\n"
        choice = obj["choices"][0]
        delta = choice.get("delta") or {}
        token = not (self.chat and delta.get("role"))  # vLLM's role chunk holds no token
        if self.chat:
            delta.pop("role", None)  # the client has P's role chunk
        if not token:  # D's role chunk: the client has P's (with its usage, if any)
            return b""
        text = _choice_text(choice, self.chat)
        # this event's text was all P's (the client has it), or it is D's copy of a token
        # whose text was empty on P
        emptied = not text and not self.remaining
        if text:
            n = min(len(text), len(self.remaining))
            if text[:n] != self.remaining[:n]:
                raise FirstTokenMismatch(f"the decode server's first token began {text[:n]!r}, "
                                         f"the prefill server's {self.remaining[:n]!r}")
            self.remaining, text = self.remaining[n:], text[n:]
            emptied = not text
            if self.chat:
                if text:
                    delta["content"] = text
                else:
                    delta.pop("content", None)
            else:
                choice["text"] = text
        if not self.remaining:
            # D's copy of the token ends here -- also an event of a token whose text was empty
            # on P (held-back bytes): that event is D's copy, not a token of its own
            self.done = token
        elif choice.get("finish_reason") is not None:  # e.g. D's first token was an end of
            # sequence (no text) where P's was not
            raise FirstTokenMismatch(f"the decode server's choice finished "
                                     f"({choice['finish_reason']}) before {self.remaining!r} "
                                     f"of the prefill server's token")
        # an event whose text was all P's goes unless it ends the choice: its usage, if any
        # (``continuous_usage_stats``), is cumulative and comes again with the next event
        meaningful = text or choice.get("finish_reason") is not None or (
            obj.get("usage") and not emptied) or (
            self.chat and any(v not in (None, "") for v in (choice.get("delta") or {}).values()))
        return _event(obj) if meaningful else b""
