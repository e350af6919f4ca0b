"""Which vLLM build and models each backend serves, for the first token from P (``first_token.py``).

A token whose text holds replacement characters (U+FFFD: bytes of a character that the next
token completes) is detokenized alike by two servers of one vLLM version serving one model, but
a detokenizer that holds such bytes back on one side and not the other would end the client's
stream in a mismatch. So the router takes such a first token from P only where P and D are known
to run the same build: the same ``/version`` and, where ``/v1/models`` answers without a key,
the same served models (id and root). The router reads both at start-up, again after a backend
could not be connected to and came back, and when its reading is older than :data:`MAX_AGE_S`
(in the background, at the next request that could use it: a server restarted with another
version is seen within that time, or at once if a leg failed while it was down). What cannot be
read is unknown (read again after :data:`RETRY_S`), and unknown is never the same build. Tokenizer
settings (``--tokenizer-mode``, a tokenizer of its own) are not visible this way: P and D meant to
serve one model are expected to be started alike; where they are not, a mismatch is still caught
and counted, never hidden (``first_token.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

#: seconds a backend's build reading is trusted before it is read again
MAX_AGE_S = 30.0
#: seconds before a backend whose build could not be read (not up yet, say) is tried again
RETRY_S = 1.0
#: seconds one reading may take
READ_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Build:
    """What a backend said it runs: its vLLM version, and its models ((id, root) pairs, sorted)
    -- None where ``/v1/models`` wants a key (the router has none of its own)."""

    version: str
    models: tuple[tuple[str, str], ...] | None


def same_build(p: Build | None, d: Build | None) -> bool:
    """Do P and D provably detokenize alike (both read, one version, the same models)?"""
    return p is not None and d is not None and p == d


async def read_build(session: aiohttp.ClientSession, url: str, proxy: str | None) -> Build | None:
    """GET ``url``/version and ``url``/v1/models; None when the version cannot be read."""
    timeout = aiohttp.ClientTimeout(total=READ_TIMEOUT_S)

    async def get(path: str) -> Any:
        async with session.get(url + path, proxy=proxy, timeout=timeout,
                               allow_redirects=False) as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None)

    try:
        ver = await get("/version")
        version = ver.get("version") if isinstance(ver, dict) else None
        if not isinstance(version, str) or not version:
            return None
        listing = await get("/v1/models")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    models = None
    if isinstance(listing, dict) and isinstance(listing.get("data"), list):
        models = tuple(sorted((str(m.get("id")), str(m.get("root") or m.get("id")))
                              for m in listing["data"] if isinstance(m, dict)))
    return Build(version, models)


class BuildBook:
    """The router's readings, by backend URL. ``refresh`` starts a reading in the background
    where none is under way and the last is missing or stale (or ``force``)."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._builds: dict[str, Build | None] = {}
        self._read_at: dict[str, float] = {}
        self._reading: set[str] = set()

    def reading(self) -> bool:
        """Is a reading under way?"""
        return bool(self._reading)

    def get(self, url: str) -> Build | None:
        return self._builds.get(url)

    def stale(self, url: str) -> bool:
        at = self._read_at.get(url)
        max_age = MAX_AGE_S if self._builds.get(url) is not None else RETRY_S
        return at is None or self.clock() - at > max_age

    def due(self, url: str, force: bool = False) -> bool:
        """Should a reading of ``url`` start now (and is it marked as under way)?"""
        if url in self._reading or not (force or self.stale(url)):
            return False
        self._reading.add(url)
        return True

    def record(self, url: str, build: Build | None) -> None:
        before = self._builds.get(url)
        self._builds[url] = build
        self._read_at[url] = self.clock()
        self._reading.discard(url)
        if build != before:
            if build is None:
                logger.info("%s: its vLLM version could not be read: first tokens with partial "
                            "characters come from D for requests through it", url)
            else:
                logger.info("%s runs vLLM %s, models %s", url, build.version,
                            "unknown (/v1/models wants a key)" if build.models is None
                            else ", ".join(f"{i} ({r})" for i, r in build.models))
