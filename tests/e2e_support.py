"""What the real-vLLM end-to-end modules share (tests/test_e2e_vllm*.py): the vLLM environments
to test, the prompts, requests and their comparable signatures, reference outputs from one
server alone (computed once per vLLM version and session), and "the server is idle" checks.

Signatures compare token ids, per-token logprobs and text: the tiny random model's text is
repetitive, so text alone proves little (shared/notes/vllm-on-cpu.md).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import httpx

from kv_push.common.testing.vllm_servers import (Server, build_tiny_model, free_port, metric,
                                                 server_dtype, vllm_server)

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8
NUM_PROMPTS = 20
#: a request that takes longer than this through P/D is broken (they take ~1 s here)
REQUEST_BOUND_S = 30.0


def venvs() -> list[tuple[str, str]]:
    """(version, python) of each vLLM environment to test (``KV_PUSH_E2E_VENVS``)."""
    spec = os.environ.get("KV_PUSH_E2E_VENVS", "0.32=.venv,0.29=.venv-vllm029")
    out = []
    for item in spec.split(","):
        version, _, path = item.partition("=")
        out.append((version.strip(), str(REPO / path.strip() / "bin" / "python")))
    return out


def heavy_venvs() -> list[tuple[str, str]]:
    """The environments for the heavy cases (faults, TP 2, incompatible peers): the first one
    only, unless ``KV_PUSH_E2E_HEAVY=all`` (keeps ``make test``, which runs two versions, short)."""
    all_ = venvs()
    return all_ if os.environ.get("KV_PUSH_E2E_HEAVY") == "all" else all_[:1]


def tiny_model_path() -> Path:
    """The suite's tiny model (built once, under .work/)."""
    return build_tiny_model(REPO / ".work" / "tiny-model")


def make_prompts(model: Path) -> list[str]:
    """20 distinct prompts of 130-600 tokens, plus two that share a long prefix with prompt 0."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    words = "the quick brown fox jumps over lazy dog prefill decode cache block token layer " \
            "head byte rank push pull server latency key value memory numbers 0 1 2 3 4 5 6 7 8 9"
    vocab = words.split()
    rng = random.Random(1234)
    out = []
    while len(out) < NUM_PROMPTS:
        target = rng.randint(130, 600)
        text = " ".join(rng.choice(vocab) for _ in range(target))
        ids = tok(text)["input_ids"]
        if len(ids) > 600:
            text = tok.decode(ids[:600])
        n = len(tok(text)["input_ids"])
        if 130 <= n <= 600:
            out.append(text)
    base = out[0]
    out.append(base + " and then something else entirely different 1 2 3")  # partial D hit
    out.append(base)  # full prompt again: D's cache holds all but the last block
    return out


def body(prompt: Any, **kw) -> dict:
    """A greedy completion request with logprobs and token ids (``kw`` overrides)."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 1, "return_token_ids": True, **kw}


def complete(url: str, prompt: Any, timeout: float = 180, **kw) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=body(prompt, **kw), timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


#: how far a P/D logprob may be from the single server's. vLLM's CPU build computes the first
#: token's logits in the single server's prefill (all prompt tokens in one forward) but on D
#: from a one-token recompute of the last prompt token over the KV P wrote: on a CPU without
#: native bf16 (AVX2 only: bf16 emulated, matmuls blocked by batch shape) the two round
#: differently, measured 1e-5 to 5e-5 apart (2026-12-06), where the AVX-512 box of earlier
#: stops gave equal bits. A wrong or missing KV block moves logprobs by far more (and tokens
#: and text are still compared exactly).
LOGPROB_TOLERANCE = 1e-3


class Signature(tuple):
    """(token ids, logprobs, text) of one choice. Equal to another when the token ids and the
    text are equal and each logprob is within :data:`LOGPROB_TOLERANCE` of its counterpart."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, tuple) or len(other) != 3 or len(self) != 3:
            return NotImplemented
        ids, lps, text = self
        o_ids, o_lps, o_text = other
        if ids != o_ids or text != o_text or len(lps) != len(o_lps):
            return False
        return all((a is None and b is None) or (a is not None and b is not None
                                                 and abs(a - b) <= LOGPROB_TOLERANCE)
                   for a, b in zip(lps, o_lps))

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:  # equal signatures hash alike: not the logprobs, compared loosely
        return hash((self[0], self[2]))


def signature(choice: dict) -> Signature:
    return Signature((tuple(choice.get("token_ids") or ()),
                      tuple(choice["logprobs"]["token_logprobs"]), choice["text"]))


def signatures(response: dict) -> tuple:
    """All choices of a response in index order (a prompt list or ``n > 1`` has several)."""
    return tuple(signature(c) for c in sorted(response["choices"], key=lambda c: c["index"]))


def list_request(prompts: list[str]) -> dict:
    """Item 1 of issue 9: a list of two prompts in one request."""
    return body([prompts[6], prompts[7]])


def n2_request(prompts: list[str]) -> dict:
    """Item 1 of issue 9: two samples of one prompt, seeded (vLLM seeds sample i with seed+i)."""
    return body(prompts[8], n=2, temperature=0.8, top_p=0.95, seed=1234)


class References:
    """Outputs of one vLLM server alone, per version: computed once per session, by whichever
    module asks first, so the modules sharing a version start that server once."""

    _cache: dict[str, dict] = {}

    @classmethod
    def get(cls, version: str, python: str, model: Path, prompts: list[str],
            log_dir: Path) -> dict:
        if version not in cls._cache:
            single = vllm_server("single", python=python, model=str(model), port=free_port(),
                                 cpu=0, log_dir=log_dir)
            try:
                single.wait_healthy()
                complete(single.url, prompts[1])  # warm-up
                ref: dict[Any, tuple] = {p: signature(complete(single.url, p)["choices"][0])
                                         for p in prompts}
                for name, req in (("list", list_request(prompts)), ("n2", n2_request(prompts))):
                    r = httpx.post(f"{single.url}/v1/completions", json=req, timeout=180)
                    assert r.status_code == 200, r.text
                    ref[name] = signatures(r.json())
            finally:
                single.stop()
            cls._cache[version] = ref
        return cls._cache[version]


def busy(server: Server) -> dict[str, float]:
    """What a vLLM server still holds: running and waiting requests, KV cache usage (blocks held
    past a request's end -- a producer's prefill waiting for its push, a decoder's blocks fenced
    after an abort -- count there; prefix-cached blocks count as free)."""
    return {"running": metric(server.url, "vllm:num_requests_running"),
            "waiting": metric(server.url, "vllm:num_requests_waiting"),
            "kv_usage": metric(server.url, "vllm:kv_cache_usage_perc")}


def wait_idle(servers: list[Server], within: float) -> tuple[bool, dict[str, dict], float]:
    """Poll until every server holds nothing (``busy`` all zero) or ``within`` seconds passed.
    Returns (idle, last state per server name, seconds waited)."""
    t0 = time.monotonic()
    while True:
        state = {s.name: busy(s) for s in servers}
        idle = all(v == 0 for held in state.values() for v in held.values())
        waited = time.monotonic() - t0
        if idle or waited > within:
            return idle, state, waited
        time.sleep(0.5)


def assert_idle(servers: list[Server], within: float) -> float:
    """``wait_idle``; on failure, fail with what each server holds and the last lines its
    connector logged (its workers' state logs among them). Returns the seconds waited."""
    idle, state, waited = wait_idle(servers, within)
    if not idle:
        dump = "\n".join(f"--- {s.name} ---\n" + log_lines(s, "kv_push") for s in servers)
        raise AssertionError(f"work left behind after {waited:.0f} s: {state}\n{dump}")
    return waited


def log_lines(server: Server, *needles: str, last: int = 40) -> str:
    """The last ``last`` lines of a server's log that contain any of ``needles``."""
    lines = [ln for ln in server.log_text().splitlines() if any(n in ln for n in needles)]
    return "\n".join(lines[-last:])


def dtype_note() -> str:
    dtype, why = server_dtype()
    return f"--dtype {dtype or 'of the model (bf16)'}: {why}"
