"""The router's reading of each backend's vLLM build (``common/router/builds.py``): what it reads
from a server's ``/version`` and ``/v1/models``, what counts as the same build, and when a
reading is done again."""

from __future__ import annotations

import aiohttp
import pytest
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse

from kv_push.common.router import builds
from kv_push.common.router.builds import Build, BuildBook, read_build, same_build

from fake_vllm import FakeVLLM, bind, serve_all


async def _read(app) -> Build | None:
    sock, url = bind()
    async with serve_all([(app, sock)]):
        async with aiohttp.ClientSession() as session:
            return await read_build(session, url, None)


async def test_a_servers_version_and_models_are_read():
    srv = FakeVLLM("p0", "prefill")
    assert await _read(srv.app) == Build("0.32.0+fake", (("fake-model", "/models/fake"),))
    srv.behavior.version = None
    assert await _read(srv.app) is None  # no version: unknown


async def test_models_behind_a_key_leave_the_version_alone_to_compare():
    app = FastAPI()
    app.get("/version")(lambda: JSONResponse({"version": "0.32.0"}))
    app.get("/v1/models")(lambda: Response(status_code=401))
    assert await _read(app) == Build("0.32.0", None)


@pytest.mark.parametrize("answer", [b"not json", b'{"version": 3}', b"[]", b'{"version": ""}'])
async def test_an_unreadable_version_is_unknown(answer):
    app = FastAPI()
    app.get("/version")(lambda: Response(answer, media_type="application/json"))
    assert await _read(app) is None


async def test_a_backend_that_is_not_up_is_unknown():
    sock, url = bind()
    sock.close()  # nothing listens there
    async with aiohttp.ClientSession() as session:
        assert await read_build(session, url, None) is None


def test_unknown_is_never_the_same_build():
    b = Build("0.32.0", (("m", "/m"),))
    assert same_build(b, Build("0.32.0", (("m", "/m"),)))
    assert not same_build(b, Build("0.29.0", (("m", "/m"),)))
    assert not same_build(b, Build("0.32.0", (("m", "/other"),)))
    assert not same_build(b, None) and not same_build(None, None)


def test_readings_are_done_again_when_stale_and_unknown_ones_sooner():
    now = [100.0]
    book = BuildBook(clock=lambda: now[0])
    b = Build("0.32.0", None)
    assert book.due("u") and not book.due("u")  # one reading at a time
    assert book.reading()
    book.record("u", b)
    assert not book.reading() and book.get("u") == b
    assert not book.due("u")
    now[0] += builds.MAX_AGE_S + 0.1
    assert book.due("u")
    book.record("u", None)  # e.g. restarting
    assert not book.due("u")
    now[0] += builds.RETRY_S + 0.1
    assert book.due("u")
    book.record("u", b)
    assert book.due("u", force=True)  # a backend that came back is read at once
