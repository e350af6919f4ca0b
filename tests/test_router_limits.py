"""The router's start-up check of P's and D's context lengths (``common/router/limits.py``)
without servers: what it reads from /v1/models, which pairs it names, and its retries."""

from __future__ import annotations

import asyncio
import logging

from kv_push.common.router import limits


def test_model_lengths_reads_each_models_max_model_len():
    listing = {"object": "list", "data": [
        {"id": "a", "max_model_len": 4096}, {"id": "b"}, {"id": "c", "max_model_len": True},
        "junk"]}
    assert limits.model_lengths(listing) == {"a": 4096}
    assert limits.model_lengths({"data": "x"}) is None and limits.model_lengths([]) is None


def test_mismatches_name_each_pair_and_model_that_differ():
    prefill = {"p0": {"m": 512, "other": 10}, "p1": {"m": 1024}}
    decode = {"d0": {"m": 1024, "other": 10}, "d1": {"n": 5}}
    assert limits.mismatches(prefill, decode) == [
        {"prefill": "p0", "decode": "d0", "model": "m", "prefill_max_model_len": 512,
         "decode_max_model_len": 1024}]
    text = limits.describe(limits.mismatches(prefill, decode)[0])
    assert "P's is smaller" in text and "prompts of 512-1023 tokens" in text
    other = limits.describe({"prefill": "p", "decode": "d", "model": "m",
                             "prefill_max_model_len": 2048, "decode_max_model_len": 1024})
    assert "D's is smaller" in other and "prompts of 1024 tokens or more" in other


def test_check_at_start_retries_until_every_backend_answered():
    answers = {"p": [None, None, {"m": 512}], "d": [{"m": 1024}]}
    reads, slept, found = [], [], []

    async def read(url, proxy):
        reads.append(url)
        queue = answers[url]
        return queue.pop(0) if len(queue) > 1 else queue[0]

    async def sleep(s):
        slept.append(s)

    asyncio.run(limits.check_at_start({"p": None}, {"d": None}, read, found.append, sleep))
    assert reads == ["p", "d", "p", "p"] and len(slept) == 2
    assert found == [[{"prefill": "p", "decode": "d", "model": "m",
                       "prefill_max_model_len": 512, "decode_max_model_len": 1024}]]


def test_check_at_start_gives_up_on_a_backend_that_never_answers(caplog):
    found, slept = [], []

    async def read(url, proxy):
        return None if url == "d" else {"m": 1}

    async def sleep(s):
        slept.append(s)

    with caplog.at_level(logging.INFO, logger=limits.__name__):
        asyncio.run(limits.check_at_start({"p": None}, {"d": None}, read, found.append, sleep,
                                          read_for_s=10))
    assert found == [[]] and sum(slept) == 10
    assert "not read from ['d']" in caplog.text
