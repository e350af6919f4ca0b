"""Which prefill/decode pairs cannot work together, as the decode servers report it.

In push mode a decode server (D) meets a prefill server (P) only when a request names it: D's
worker then handshakes with P's side channel, and a pair whose KV layouts, protocol or NIXL
releases do not match is refused there. vLLM fails such a request with a generic
``Internal server error`` (its API turns every ``FINISHED_ERROR`` into that message; a KV
connector has no way to put a reason in the response). The connector counts each refusal on D
as ``vllm:kv_push_handshake_refusals_total{reason="P_HOST:P_PORT REASON"}`` (the side channel
D dialled, i.e. the router's ``kv=`` of that P); the router reads D's ``/metrics`` when a D leg
fails and when ``/health?probe=true`` is asked, and so can tell the client and the operator why.

A refusal counted before a later success of the same pair is history (one side was
reconfigured): only refusals beyond D's count when the pair last worked mark it. When a pair
with refusals on record works, the router does not know D's count at that moment -- it read it
earlier, and D may have counted more since (several for one failed request, or for requests the
router did not look at) -- so ``worked`` asks for a fresh read (``rebase``), and until then
the next look only takes D's count as the baseline (a failure in between is left unexplained
rather than wrongly explained: a pair that works again must not be reported incompatible on its
old refusals). A pair with no refusals on record keeps the count of the last look.

The refusals D counted before this router started are history too: it reads every D's count at
start-up (``baseline``). A D it could not read then (not up yet, as when everything starts together)
has its every refusal counted, as before. A count below the baseline means D restarted: what it
counted since is new (a restarted D whose count has climbed back to the baseline is not told
apart). A ``/metrics`` that cannot be read tells nothing: the pair stays as it was. (Until
2026-12-05 a restarted router took every refusal D had ever counted for new: a pair that had
been fixed showed as incompatible, ``/health`` answered 503 until a request went through it --
which a readiness check that takes the router out of service never lets happen -- and a failure
of D for any other reason was blamed on the old refusal.)
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("kv_push.router")

REFUSALS_METRIC = "vllm:kv_push_handshake_refusals_total"
# what reads as a network address in a refusal's text: a URL, IPv4[:port], [IPv6]:port, host:port
_ADDRESS = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s,;()\]]+"
                      r"|\[[0-9a-fA-F:.]+\](?::\d+)?"
                      r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"
                      r"|\b(?:localhost|[a-zA-Z][\w-]*(?:\.[\w-]+)+):\d{1,5}\b")


def without_addresses(text: str) -> str:
    """``text`` with network addresses (URLs, host:port, IPs) replaced by ``<address>``: what a
    client may read of a refusal (the operator gets the addresses in the log and ``/health``)."""
    return _ADDRESS.sub("<address>", text)
_REASON = re.compile(r'reason="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_refusals(metrics_text: str) -> dict[str, tuple[str, float]]:
    """From a decode server's ``/metrics``: producer ``HOST:PORT`` -> (latest reason, count of
    refusals of all reasons). Lines that do not parse are skipped."""
    out: dict[str, tuple[str, float]] = {}
    for line in metrics_text.splitlines():
        if not line.startswith(REFUSALS_METRIC + "{"):
            continue
        head, _, value = line.rpartition(" ")
        m = _REASON.search(head)
        try:
            count = float(value)
        except ValueError:
            continue
        if m is None or count <= 0:
            continue
        label = re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], m.group(1))
        address, _, reason = label.partition(" ")
        if not address or not reason:
            continue
        _old, total = out.get(address, ("", 0.0))
        out[address] = (reason, total + count)
    return out


@dataclass(frozen=True)
class Incompatibility:
    prefill: str  # P's URL
    kv: str  # P's side channel HOST:PORT
    decode: str  # D's URL
    reason: str

    def message(self) -> str:
        return (f"prefill {self.prefill} (KV side channel {self.kv}) and decode {self.decode} "
                f"are incompatible, so no request can be served by this pair until one of them "
                f"is reconfigured: {self.reason}")

    def client_message(self) -> str:
        """``message`` without addresses: what differs, not where (for the client's error)."""
        reason = self.reason
        for known in (self.prefill, self.kv, self.decode):
            reason = reason.replace(known, "<address>")
        return ("the prefill and decode servers picked for this request are incompatible, so no "
                "request can be served by this pair until one of them is reconfigured: "
                + without_addresses(reason))

    def as_dict(self) -> dict[str, str]:
        return {"prefill": self.prefill, "kv": self.kv, "decode": self.decode,
                "reason": self.reason}


#: at most one read of D's /metrics per pair this often after successes, where nothing asks for
#: one sooner (refusals on record, or a rebase whose read failed): ``PairCompat.worked``
REBASE_EVERY_S = 30.0

#: how long the router steers requests away from a pair it found incompatible; then the pair
#: may be picked again (a side may have been reconfigured: its next failure marks it again)
AVOID_S = 30.0


class PairCompat:
    """What the router knows about (P, D) pairs; single-threaded (the router's event loop)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.incompatible: dict[tuple[str, str], Incompatibility] = {}
        self._found_at: dict[tuple[str, str], float] = {}  # when each was last found incompatible
        self._seen: dict[tuple[str, str], float] = {}  # refusals counted when last judged
        # refusals counted at the pair's last success (None: unknown, the next look tells)
        self._cleared: dict[tuple[str, str], float | None] = {}
        self._rebased_at: dict[tuple[str, str], float] = {}  # when worked() last asked a read

    def judge(self, prefill: str, kv: str, decode: str,
              refusals: dict[str, tuple[str, float]] | None) -> Incompatibility | None:
        """Given D's refusals (``parse_refusals``; None: D's ``/metrics`` could not be read,
        which tells nothing), is the pair incompatible now? Logs the first time it is (and
        again when the reason changes)."""
        pair = (prefill, decode)
        if refusals is None:
            return self.incompatible.get(pair)
        reason, count = refusals.get(kv, ("", 0.0))
        self._seen[pair] = count
        cleared = self._cleared.get(pair, 0.0)
        if cleared is None:  # the first look after the pair worked (no read since)
            self._cleared[pair] = count
            return None
        if count < cleared:  # D restarted (its counters with it): all it counted since is new
            cleared = self._cleared[pair] = 0.0
        if count <= cleared:
            return self.incompatible.get(pair)
        found = Incompatibility(prefill, kv, decode, reason)
        if self.incompatible.get(pair) != found:
            logger.error("%s (decode server's handshake refusals: %d; see GET /health)",
                         found.message(), count)
        self.incompatible[pair] = found
        self._found_at[pair] = self.clock()
        return found

    def baseline(self, kvs: dict[str, str], decode: str,
                 refusals: dict[str, tuple[str, float]]) -> None:
        """D's refusals as this router first reads them (at its start; ``kvs``: each prefill
        URL's side channel HOST:PORT): history, for every pair not looked at yet."""
        for prefill, kv in kvs.items():
            pair = (prefill, decode)
            if pair not in self._cleared:
                self._cleared[pair] = self._seen[pair] = refusals.get(kv, ("", 0.0))[1]

    def avoided(self, prefill: str) -> set[str]:
        """The decode URLs to steer ``prefill``'s requests away from: found incompatible with
        it within the last ``AVOID_S`` (where another decode server is up)."""
        now = self.clock()
        return {d for (p, d) in self.incompatible
                if p == prefill and now - self._found_at.get((p, d), -AVOID_S) < AVOID_S}

    def worked(self, prefill: str, decode: str) -> bool:
        """A request through the pair succeeded: earlier refusals are history. True when D's
        count is wanted now (``rebase``): at once when the pair was found incompatible or a
        look saw more refusals than the baseline holds; where D has refusals on record (some
        D may have counted since the router's last look) or a rebase's read failed, at most
        every ``REBASE_EVERY_S``. (Asking after every success of a pair whose D refused it once,
        long ago, read D's whole ``/metrics`` after every request through the pair, for as
        long as D ran: a cold review's finding.) A pending rebase the router does not read is
        taken by the pair's next look (``judge``)."""
        pair = (prefill, decode)
        self._found_at.pop(pair, None)
        was = self.incompatible.pop(pair, None) is not None
        if was:
            logger.info("prefill %s and decode %s work together again", prefill, decode)
        cleared, seen = self._cleared.get(pair, 0.0), self._seen.get(pair, 0.0)
        now = self.clock()
        due = now - self._rebased_at.get(pair, -REBASE_EVERY_S) >= REBASE_EVERY_S
        if was or (cleared is not None and seen > cleared) or (
                due and (cleared is None or seen > 0)):
            self._cleared[pair] = None  # D's count now is unknown: rebase, or the next look
            self._rebased_at[pair] = now
            return True
        return False

    def rebase(self, prefill: str, kv: str, decode: str,
               refusals: dict[str, tuple[str, float]] | None) -> None:
        """D's refusals read right after the pair worked (None: D's ``/metrics`` could not be
        read): its count is the baseline (unless a look since then took one)."""
        pair = (prefill, decode)
        if refusals is not None and self._cleared.get(pair, 0.0) is None:
            count = refusals.get(kv, ("", 0.0))[1]
            self._cleared[pair] = self._seen[pair] = count
