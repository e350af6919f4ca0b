"""Which NIXL releases may talk to each other, decided at the side-channel handshake.

Both handshake messages carry the sender's NIXL version (``Hello.nixl_version``,
``Welcome.nixl_version``); each side calls ``check_peer_nixl(ours, theirs)`` before it loads the
peer's agent metadata and refuses the peer with the returned reason. The rules, from NIXL's
sources (docs/neuron.md, "NIXL versions"):

* NIXL 1.4.0 added a peer handshake to the LIBFABRIC backend (ai-dynamo/nixl#1736, in v1.4.0 as
  #2035): its first transfer or notification to a peer waits up to 60 s for a handshake message
  that NIXL 1.3.x never sends, then fails. 1.3.x and 1.4.0+ cannot be paired.
* Beyond that, only releases of one series (same major.minor) are paired: NIXL promises no
  metadata compatibility across series, and only 1.5.1 <-> 1.5.1 has been run here (UCX).
* Equal version strings always pair (including two unknown, empty ones: no nixl installed).
"""

from __future__ import annotations

import re
from functools import lru_cache

#: the first NIXL release whose LIBFABRIC backend waits for the peer handshake
LIBFABRIC_HANDSHAKE_SINCE = (1, 4)
#: pairs run here, for the refusal message
TESTED_PAIRS = ("1.5.1 <-> 1.5.1 (UCX)",)

_VERSION = re.compile(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?")


def parse_nixl_version(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version such as "1.5.1" or "1.3.2.dev0"; None if not one."""
    m = _VERSION.match(version or "")
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def libfabric_waits_for_handshake(version: str) -> bool:
    """Whether NIXL ``version``'s LIBFABRIC backend makes the first call to a peer wait for that
    peer's handshake (1.4.0 and later; an unknown version is taken to)."""
    v = parse_nixl_version(version)
    return v is None or v[:2] >= LIBFABRIC_HANDSHAKE_SINCE


def check_peer_nixl(ours: str, theirs: str) -> str | None:
    """None when a peer on NIXL ``theirs`` may be paired with us on ``ours``; else why not."""
    if ours == theirs:
        return None
    a, b = parse_nixl_version(ours), parse_nixl_version(theirs)
    if a is None or b is None:
        return (f"cannot tell whether NIXL {ours or '(unknown)'} here and "
                f"{theirs or '(unknown)'} on the peer interoperate: install the same NIXL "
                f"release on P and D")
    if (a[:2] >= LIBFABRIC_HANDSHAKE_SINCE) != (b[:2] >= LIBFABRIC_HANDSHAKE_SINCE):
        return (f"NIXL {ours} here and {theirs} on the peer: NIXL 1.4.0 and later wait for a "
                f"LIBFABRIC peer handshake that earlier releases never send (first transfer "
                f"stalls 60 s, then fails); install the same NIXL release on P and D")
    if a[:2] != b[:2]:
        return (f"NIXL {ours} here and {theirs} on the peer are different release series; "
                f"pair only releases with the same major.minor (run here: "
                f"{', '.join(TESTED_PAIRS)})")
    return None


@lru_cache(maxsize=1)
def local_nixl_version() -> str:
    """The installed NIXL distribution's version ("" when none is installed)."""
    from importlib import metadata  # noqa: PLC0415

    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return ""
