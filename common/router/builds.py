"""Which vLLM build and models each backend serves, for the first token from P (``first_token.py``).

A token whose text holds replacement characters (U+FFFD: bytes of a character that the next
token completes) came out alike from P and D in every case measured where both ran one vLLM
version on one model, but a detokenizer that holds such bytes back on one side and not the other
would end the client's stream in a mismatch. So the router takes such a first token from P only
where P and every decode server a request may go to are known to run the same build: the same
``GET /version`` and the same ``GET /v1/models`` (each model's id and root, the root being the
server's ``--model`` path; where ``/v1/models`` wants an API key -- 401 or 403 -- the version
alone). Other answers, or none, leave the build unknown, and unknown is never the same build.

This is a guard, not a proof: which detokenizer vLLM runs also depends on the tokenizer
(``--tokenizer``, its revision, its class), the installed ``tokenizers`` package and vLLM's
environment variables, none of which these endpoints show. P and D meant to serve one model are
expected to run from one image with the same flags; a URL that is a load balancer over servers
of mixed versions makes a reading meaningless (use ``--first-token-from-prefill off`` during a
rolling upgrade behind one URL). A mismatch is still caught and counted, never hidden; after one
on a token with U+FFFD, that P/D pair gets no such token from P again until either's reading
changes (:meth:`BuildBook.distrust`).

When readings are taken (always in the background; nothing on a request's path waits for one):

* at the router's start-up;
* at a request that could use one, where the last is older than :data:`MAX_AGE_S`; a reading
  older than that plus :data:`READ_TIMEOUT_S` is no longer trusted (a server restarted with
  another version is seen within that time);
* a backend that could not be connected to is forgotten at once (:meth:`BuildBook.forget`),
  and read again (forced) when it can be connected to again; a reading begun before either is
  thrown away when it ends (each URL's readings are numbered);
* an unreadable backend is tried again after :data:`RETRY_S`, doubling up to :data:`MAX_AGE_S`
  (a connection that failed counts as such a reading); a backend that is down is not read
  until it is back;
* the readings of every decoder that is up are kept fresh at each such request (P's token must
  suit any decoder the leg may move to).

Each backend's build is logged at INFO when first read and whenever it changes, an unreadable
one with why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import aiohttp

from kv_push.common.router.pool import backoff_s

logger = logging.getLogger(__name__)

#: seconds a backend's build reading is trusted without a new one being started
MAX_AGE_S = 30.0
#: seconds before an unreadable backend (not up yet, say) is tried again; doubles up to MAX_AGE_S
RETRY_S = 1.0
#: seconds one reading (both GETs) may take
READ_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Build:
    """What a backend said it runs: its vLLM version, and its models ((id, root) pairs, sorted)
    -- None where ``/v1/models`` wants a key (the router has none of its own)."""

    version: str
    models: tuple[tuple[str, str], ...] | None

    def __str__(self) -> str:
        models = ("unknown (/v1/models wants a key)" if self.models is None
                  else ", ".join(f"{i} ({r})" for i, r in self.models))
        return f"vLLM {self.version}, models {models}"


async def get_json(session: aiohttp.ClientSession, url: str, proxy: str | None
                   ) -> tuple[int, Any]:
    """GET ``url`` (through ``proxy``, no redirects): (200, its JSON) or (the status, None).
    Raises aiohttp's errors and ValueError (a body that is not JSON)."""
    async with session.get(url, proxy=proxy, allow_redirects=False) as resp:
        if resp.status != 200:
            return resp.status, None
        return 200, await resp.json(content_type=None)


async def read_build(session: aiohttp.ClientSession, url: str, proxy: str | None
                     ) -> tuple[Build | None, str]:
    """GET ``url``/version and ``url``/v1/models: (the build, "") or (None, why not)."""
    async def get(path: str) -> tuple[int, Any]:
        return await get_json(session, url + path, proxy)

    try:
        async with asyncio.timeout(READ_TIMEOUT_S):  # both GETs together
            status, ver = await get("/version")
            if status != 200:
                return None, f"GET /version answered HTTP {status}"
            version = ver.get("version") if isinstance(ver, dict) else None
            if not isinstance(version, str) or not version:
                return None, "GET /version named no version"
            status, listing = await get("/v1/models")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if status in (401, 403):  # behind --api-key: the version alone
        return Build(version, None), ""
    if status != 200 or not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
        return None, f"GET /v1/models answered HTTP {status}" if status != 200 \
            else "GET /v1/models listed no models"
    models = tuple(sorted((str(m.get("id")), str(m.get("root") or m.get("id")))
                          for m in listing["data"] if isinstance(m, dict)))
    return Build(version, models), ""


@dataclass
class _Entry:
    build: Build | None = None
    read_at: float | None = None  # when the last reading ended (None: never)
    failures: int = 0  # unreadable readings in a row
    gen: int = 0  # the current reading number: a reading of an older one is thrown away
    reading: bool = False  # a reading of ``gen`` is under way
    logged: Any = None  # what was last logged (a Build, or the reason text)


class BuildBook:
    """The router's readings, by backend URL (module doc)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        #: (P's URL, D's URL, the build both were read as) where a token with U+FFFD mismatched
        self._distrusted: set[tuple[str, str, Build]] = set()

    def _entry(self, url: str) -> _Entry:
        return self._entries.setdefault(url, _Entry())

    def reading(self) -> bool:
        """Is any reading under way?"""
        return any(e.reading for e in self._entries.values())

    def get(self, url: str) -> Build | None:
        """``url``'s build, while its reading is fresh enough to trust."""
        e = self._entries.get(url)
        if e is None or e.build is None or e.read_at is None \
                or self.clock() - e.read_at > MAX_AGE_S + READ_TIMEOUT_S:
            return None
        return e.build

    def _stale(self, e: _Entry) -> bool:
        if e.read_at is None:
            return True
        wait = MAX_AGE_S if e.build is not None else backoff_s(RETRY_S, e.failures, MAX_AGE_S)
        return self.clock() - e.read_at > wait

    def begin(self, url: str, force: bool = False) -> int | None:
        """Start a reading of ``url`` if one is due (missing or stale, or ``force``) and none of
        the current number is under way: its number, for :meth:`record`, or None."""
        e = self._entry(url)
        if force:
            e.gen += 1  # whatever is under way now is of the server before
            e.reading = False
        if e.reading or not (force or self._stale(e)):
            return None
        e.reading = True
        return e.gen

    def record(self, url: str, gen: int, build: Build | None, why: str = "",
               name: str = "") -> None:
        """A reading ended: ``build``, or None and why it could not be read (``name``: how the
        log names the backend; its URL by default)."""
        e = self._entry(url)
        if gen != e.gen:
            return  # begun before a forget or a forced reading: not about the server now
        e.reading = False
        e.build, e.read_at = build, self.clock()
        e.failures = 0 if build is not None else e.failures + 1
        shown = build if build is not None else why
        if shown != e.logged:
            e.logged = shown
            if build is not None:
                logger.info("%s runs %s", name or url, build)
            else:
                logger.info("%s: its vLLM build could not be read (%s): first tokens with "
                            "partial characters come from D for requests through it",
                            name or url, why)

    def cancelled(self, url: str, gen: int) -> None:
        """A reading was cancelled (shutdown): nothing is recorded."""
        e = self._entry(url)
        if gen == e.gen:
            e.reading = False

    def shown(self, url: str) -> str | None:
        """``url``'s build as ``/health`` shows it (None: not read, or no longer trusted)."""
        build = self.get(url)
        return None if build is None else str(build)

    def forget(self, url: str) -> None:
        """``url`` could not be connected to: its reading no longer counts (it may come back
        as another build), and one under way is thrown away."""
        e = self._entry(url)
        # as a failed reading: the next is due after the back-off, not at the next request
        e.build, e.gen, e.reading = None, e.gen + 1, False
        e.read_at, e.failures = self.clock(), e.failures + 1

    def common(self, p_url: str, d_urls: Iterable[str]) -> Build | None:
        """The build P at ``p_url`` and every D in ``d_urls`` run, as read, where no mismatch
        is on record for one of these pairs at it; else None."""
        p = self.get(p_url)
        if p is None:
            return None
        for d_url in d_urls:
            if self.get(d_url) != p or (p_url, d_url, p) in self._distrusted:
                return None
        return p

    def distrust(self, p_url: str, d_url: str, build: Build) -> None:
        """A token with U+FFFD from P did not match D's, where both were read as ``build``
        when P's token was taken: no more such tokens from this P for this D until either's
        reading changes."""
        if (p_url, d_url, build) in self._distrusted:
            return
        self._distrusted.add((p_url, d_url, build))
        logger.warning("prefill %s and decode %s both report %s, yet a first token with "
                       "partial characters differed between them (other tokenizer settings or "
                       "environments?): such tokens come from D for this pair until either's "
                       "build changes", p_url, d_url, build)
