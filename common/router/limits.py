"""P and D started with different context lengths, found at the router's start-up.

A prefill server whose ``--max-model-len`` is smaller than its decode servers' rejects every
prompt between the two with its 400 ("maximum context length is ..."), while the router's
``GET /v1/models`` (a decode server's answer) promises the larger one; the other way round, D
rejects what P would have prefilled. Neither is an error of the request. So at start-up the
router reads each backend's ``GET /v1/models`` (every model's ``max_model_len``), retrying a
backend that does not answer yet, and for every P/D pair that serves a model under one id with
different lengths logs a WARNING and lists the pair in ``/health`` (``limit_mismatches``).

Read once per backend, at start-up: a server restarted later with other flags is not read
again; what the router sees of such a pair at request time is the rejection itself
(``prefill_rejected_alone_total``, ``Router._note_rejected_by_prefill_alone``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import aiohttp

from kv_push.common.router.builds import get_json

logger = logging.getLogger(__name__)

#: how long the start-up reading keeps trying a backend that does not answer yet
READ_FOR_S = 300.0
#: seconds between tries of such a backend
RETRY_S = 2.0


def model_lengths(listing: Any) -> dict[str, int] | None:
    """``GET /v1/models``'s answer -> {model id: max_model_len} (models without a length left
    out); None when it is not a model list."""
    if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
        return None
    out = {}
    for m in listing["data"]:
        if isinstance(m, dict) and isinstance(m.get("max_model_len"), int) \
                and not isinstance(m.get("max_model_len"), bool):
            out[str(m.get("id"))] = m["max_model_len"]
    return out


async def read_lengths(session: aiohttp.ClientSession, url: str, proxy: str | None,
                       timeout_s: float = 5.0) -> dict[str, int] | None:
    """``url``'s model lengths, or None if it does not answer with a model list (yet)."""
    try:
        async with asyncio.timeout(timeout_s):
            _, listing = await get_json(session, url + "/v1/models", proxy)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    return model_lengths(listing)


def mismatches(prefill: dict[str, dict[str, int]], decode: dict[str, dict[str, int]]
               ) -> list[dict]:
    """Every (P, D, model) whose ``max_model_len`` differs, from each side's lengths by URL."""
    out = []
    for p_url, p_lens in prefill.items():
        for d_url, d_lens in decode.items():
            for model in sorted(p_lens.keys() & d_lens.keys()):
                if p_lens[model] != d_lens[model]:
                    out.append({"prefill": p_url, "decode": d_url, "model": model,
                                "prefill_max_model_len": p_lens[model],
                                "decode_max_model_len": d_lens[model]})
    return out


def describe(m: dict) -> str:
    """A mismatch as the WARNING says it."""
    p_len, d_len = m["prefill_max_model_len"], m["decode_max_model_len"]
    # (P's leg asks for one token: a prompt of max_model_len tokens leaves it none)
    smaller, effect = ("P", f"prompts of {p_len}-{d_len - 1} tokens, which D would take, fail "
                            f"with P's 400 while the router's /v1/models says {d_len}") \
        if p_len < d_len else ("D", f"prompts of {d_len} tokens or more are refused by D")
    return (f"prefill server {m['prefill']} serves {m['model']!r} with max_model_len {p_len}, "
            f"decode server {m['decode']} with {d_len} ({smaller}'s is smaller: {effect}); "
            "start P and D with the same --max-model-len")


async def check_at_start(prefill: dict[str, str | None], decode: dict[str, str | None],
                         read: Callable[[str, str | None], Awaitable[dict[str, int] | None]],
                         found: Callable[[list[dict]], None],
                         sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                         read_for_s: float = READ_FOR_S) -> None:
    """Read every backend (URL -> its proxy) until each answered or ``read_for_s`` passed, then
    hand the mismatches among those read to ``found`` (also when there are none)."""
    lengths: dict[str, dict[str, int]] = {}
    waited = 0.0
    backends = {**prefill, **decode}
    while True:
        for url, proxy in backends.items():
            if url not in lengths:
                got = await read(url, proxy)
                if got is not None:
                    lengths[url] = got
        if len(lengths) == len(backends) or waited >= read_for_s:
            break
        await sleep(RETRY_S)
        waited += RETRY_S
    unread = sorted(set(backends) - set(lengths))
    if unread:
        logger.info("context lengths not read from %s (no /v1/models answer within %g s): "
                    "their P/D pairs are not checked", unread, read_for_s)
    found(mismatches({u: lengths[u] for u in prefill if u in lengths},
                     {u: lengths[u] for u in decode if u in lengths}))
