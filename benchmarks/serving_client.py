"""The serving benchmark's load generator: exact token-id prompts, Poisson arrivals, a streaming
``/v1/completions`` client that times each request (TTFT at the first chunk carrying a choice),
open-loop rate points, a closed-loop concurrency-1 point, and the warm-up.

Kept instead of ``vllm bench serve`` only for what that tool cannot do here (see
docs/serving-benchmark.md): a time-out per request (its one is 6 h), exact distinct prompts (its
random dataset repeats prompts on a 512-token vocabulary), and per-request TTFTs of four systems
alternating in one run with the load recorded per pass.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx

from kv_push.common.testing.sse_lines import asse_lines


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` distinct random token-id prompts of exactly ``length`` tokens (ids 3.. avoid the
    tiny tokenizer's <unk>/<s>/</s>)."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    while len(out) < n:
        p = [rng.randrange(3, vocab) for _ in range(length)]
        if tuple(p) not in seen:
            seen.add(tuple(p))
            out.append(p)
    return out


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Poisson process: offsets (s) of ``n`` arrivals at ``rate`` per second, first at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                      timeout: float) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    rec: dict[str, Any] = {"prompt_len": len(prompt), "ttft": None, "e2e": None, "tpot": None,
                           "tokens": 0, "error": None}
    t0 = time.perf_counter()
    chunks = 0
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    rec["error"] = f"HTTP {resp.status_code}: {text[:200]}"
                    return rec
                async for line in asse_lines(resp.aiter_bytes()):
                    if not line.startswith("data: "):
                        continue
                    data = line[6:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if obj.get("choices"):
                        if rec["ttft"] is None:
                            rec["ttft"] = time.perf_counter() - t0
                        chunks += 1
                    if obj.get("usage"):
                        rec["tokens"] = int(obj["usage"].get("completion_tokens") or 0)
                    if obj.get("error"):
                        rec["error"] = f"stream error: {str(obj['error'])[:200]}"
        rec["e2e"] = time.perf_counter() - t0
        rec["tokens"] = rec["tokens"] or chunks
        if rec["error"] is None and rec["ttft"] is None:
            rec["error"] = "no tokens streamed"
        if rec["error"] is None and rec["tokens"] > 1:
            rec["tpot"] = (rec["e2e"] - rec["ttft"]) / (rec["tokens"] - 1)
    except TimeoutError:
        rec["error"] = f"timeout after {timeout:.0f}s"
    except (httpx.HTTPError, ValueError, OSError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:200]
    return rec


def _client(n: int, timeout: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=32)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10), limits=limits)


async def run_point(url: str, prompts: list[list[int]], offsets: list[float], max_tokens: int,
                    timeout: float) -> list[dict]:
    """Open loop: request i is sent at ``offsets[i]`` regardless of the others."""
    async with _client(len(prompts), timeout) as c:
        t0 = time.perf_counter()

        async def scheduled(i: int) -> dict:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            lag = time.perf_counter() - t0 - offsets[i]
            rec = await one_request(c, url, prompts[i], max_tokens, timeout)
            rec.update(i=i, arrival=offsets[i], send_lag=lag)
            return rec

        # every task carries its own timeout, so this gather is bounded by last offset + timeout
        return list(await asyncio.gather(*(scheduled(i) for i in range(len(prompts)))))


async def run_closed(url: str, prompts: list[list[int]], max_tokens: int,
                     timeout: float) -> list[dict]:
    """Concurrency 1: each request is sent when the previous one has ended (``arrival`` is its
    send time from the point's start, ``send_lag`` 0)."""
    out = []
    async with _client(1, timeout) as c:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            at = time.perf_counter() - t0
            rec = await one_request(c, url, p, max_tokens, timeout)
            rec.update(i=i, arrival=at, send_lag=0.0)
            out.append(rec)
    return out


async def warm_up(url: str, lengths: list[int], vocab: int, max_tokens: int, seed: int,
                  timeout: float) -> list[dict]:
    """First request (slow on CPU: first forward passes, handshakes), then every prompt length
    once, then a small concurrent burst. Stops at the first failure (each request is bounded by
    ``timeout``)."""
    out = []
    async with httpx.AsyncClient(timeout=timeout) as c:
        first = make_prompts(1, lengths[0], vocab, seed)[0]
        out.append(await one_request(c, url, first, max_tokens, timeout))
        for j, n in enumerate(lengths):
            if out[-1]["error"]:
                return out
            p = make_prompts(1, n, vocab, seed + 1 + j)[0]
            out.append(await one_request(c, url, p, max_tokens, timeout))
        if out[-1]["error"]:
            return out
        burst = make_prompts(4, lengths[-1], vocab, seed + 99)
        out += await asyncio.gather(*(one_request(c, url, p, max_tokens, timeout)
                                      for p in burst))
    return out
