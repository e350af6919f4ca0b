"""The router's reading of each backend's vLLM build (``common/router/builds.py``): what it reads
from a server's ``/version`` and ``/v1/models``, what counts as the same build, and when a
reading is taken, trusted, thrown away or done again."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse

from kv_push.common.router import builds
from kv_push.common.router.builds import Build, BuildBook, read_build

from fake_vllm import FakeVLLM, bind, serve_all

B32 = Build("0.32.0", (("m", "/m"),))
B29 = Build("0.29.0", (("m", "/m"),))


async def _read(app) -> tuple[Build | None, str]:
    sock, url = bind()
    async with serve_all([(app, sock)]):
        async with aiohttp.ClientSession() as session:
            return await read_build(session, url, None)


async def test_a_servers_version_and_models_are_read():
    srv = FakeVLLM("p0", "prefill")
    assert await _read(srv.app) == (Build("0.32.0+fake", (("fake-model", "/models/fake"),)), "")
    srv.behavior.version = None
    assert await _read(srv.app) == (None, "GET /version answered HTTP 404")


@pytest.mark.parametrize("status", [401, 403])
async def test_models_behind_a_key_leave_the_version_alone_to_compare(status):
    app = FastAPI()
    app.get("/version")(lambda: JSONResponse({"version": "0.32.0"}))
    app.get("/v1/models")(lambda: Response(status_code=status))
    assert await _read(app) == (Build("0.32.0", None), "")


@pytest.mark.parametrize("status", [404, 500, 502])
async def test_models_that_cannot_be_listed_otherwise_leave_the_build_unknown(status):
    # a gateway's page or a failing server is not "behind a key": nothing to compare
    app = FastAPI()
    app.get("/version")(lambda: JSONResponse({"version": "0.32.0"}))
    app.get("/v1/models")(lambda: Response(status_code=status))
    assert await _read(app) == (None, f"GET /v1/models answered HTTP {status}")


@pytest.mark.parametrize("answer", [b"not json", b'{"version": 3}', b"[]", b'{"version": ""}'])
async def test_an_unreadable_version_is_unknown(answer):
    app = FastAPI()
    app.get("/version")(lambda: Response(answer, media_type="application/json"))
    build, why = await _read(app)
    assert build is None and why


async def test_a_backend_that_is_not_up_is_unknown():
    sock, url = bind()
    sock.close()  # nothing listens there
    async with aiohttp.ClientSession() as session:
        build, why = await read_build(session, url, None)
    assert build is None and "Connect" in why


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _read_now(book: BuildBook, url: str, build: Build | None, why: str = "") -> None:
    gen = book.begin(url)
    assert gen is not None
    book.record(url, gen, build, why)


def test_unknown_is_never_the_same_build_and_every_decoder_counts():
    book = BuildBook(clock=Clock())
    _read_now(book, "p", B32)
    _read_now(book, "d1", B32)
    assert book.common("p", ["d1"]) == B32
    assert book.common("p", ["d1", "d2"]) is None  # d2 never read
    _read_now(book, "d2", B29)
    assert book.common("p", ["d1", "d2"]) is None and book.common("p", ["d2"]) is None
    _read_now(book, "d3", Build("0.32.0", (("m", "/other"),)))
    assert book.common("p", ["d3"]) is None
    assert book.common("never", ["d1"]) is None


def test_a_reading_is_redone_when_stale_and_untrusted_soon_after():
    clock = Clock()
    book = BuildBook(clock=clock)
    gen = book.begin("u")
    assert gen is not None and book.begin("u") is None  # one reading at a time
    assert book.reading()
    book.record("u", gen, B32)
    assert not book.reading() and book.get("u") == B32 and book.begin("u") is None
    clock.now += builds.MAX_AGE_S + 0.1
    assert book.get("u") == B32  # stale: a new reading starts, the old one still counts ...
    assert book.begin("u") is not None
    clock.now += builds.READ_TIMEOUT_S
    assert book.get("u") is None  # ... but not past the time a reading may take


def test_unreadable_backends_are_tried_again_later_and_later():
    clock = Clock()
    book = BuildBook(clock=clock)
    waits = []
    for _ in range(8):
        _read_now(book, "u", None, "GET /version answered HTTP 404")
        start = clock.now
        while book.begin("u") is None:
            clock.now += 0.25
        book.cancelled("u", book._entries["u"].gen)
        waits.append(clock.now - start)
    assert waits[0] <= builds.RETRY_S + 0.25 and waits[1] > waits[0] and waits[2] > waits[1]
    assert max(waits) <= builds.MAX_AGE_S + 0.25
    _read_now(book, "u", B32)  # readable again: fresh for MAX_AGE_S
    assert book.begin("u") is None


def test_a_backend_that_cannot_be_connected_to_backs_off_as_an_unreadable_one():
    clock = Clock()
    book = BuildBook(clock=clock)
    _read_now(book, "u", B32)
    book.forget("u")
    assert book.get("u") is None and book.begin("u") is None  # not at every request ...
    clock.now += builds.RETRY_S + 0.1
    gen = book.begin("u")
    assert gen is not None  # ... after the back-off
    book.forget("u")  # still down: the reading under way is thrown away, the wait doubles
    clock.now += builds.RETRY_S + 0.1
    assert book.begin("u") is None
    clock.now += builds.RETRY_S
    assert book.begin("u") is not None
    for _ in range(2000):  # a backend down for hours: 2 ** 1024 would overflow a float
        book.forget("u")
    assert book.begin("u") is None  # (raised OverflowError in every eligible request)
    clock.now += builds.MAX_AGE_S + 0.1
    assert book.begin("u") is not None  # the wait stays capped


def test_a_reading_begun_before_a_forget_or_a_forced_reading_is_thrown_away():
    book = BuildBook(clock=Clock())
    _read_now(book, "u", B32)
    old = book.begin("u", force=True)  # e.g. the router's start-up reading ...
    book.forget("u")  # ... then a leg could not connect: the server may come back as another
    assert book.get("u") is None
    book.record("u", old, B32)  # the old server's answer arrives late
    assert book.get("u") is None
    new = book.begin("u", force=True)  # back: read at once
    stale = new - 1
    book.record("u", stale, B32)
    assert book.get("u") is None and book.reading()
    book.record("u", new, B29)
    assert book.get("u") == B29 and not book.reading()


def test_a_mismatch_distrusts_the_pair_until_a_build_changes(caplog):
    book = BuildBook(clock=Clock())
    for url in ("p", "d", "d2"):
        _read_now(book, url, B32)
    with caplog.at_level(logging.WARNING, logger=builds.__name__):
        book.distrust("p", "d", B32)
        book.distrust("p", "d", B32)
    assert len([r for r in caplog.records if "differed" in r.getMessage()]) == 1
    assert book.common("p", ["d"]) is None and book.common("p", ["d2"]) == B32
    for url in ("p", "d"):  # both upgraded: a new pair of builds
        book.record(url, book.begin(url, force=True), Build("0.33.0", B32.models))
    assert book.common("p", ["d"]) == Build("0.33.0", B32.models)


def test_each_backend_is_logged_when_first_read_and_when_it_changes(caplog):
    book = BuildBook(clock=Clock())
    with caplog.at_level(logging.INFO, logger=builds.__name__):
        for build, why in ((None, "GET /version answered HTTP 404"),
                           (None, "GET /version answered HTTP 404"),
                           (B32, ""), (B32, ""), (B29, "")):
            book.record("u", book.begin("u", force=True), build, why)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "could not be read (GET /version answered HTTP 404)" in lines[0]
    assert "runs vLLM 0.32.0, models m (/m)" in lines[1] and "vLLM 0.29.0" in lines[2]
