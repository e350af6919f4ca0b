"""Configuration of the P/D router (``kv-push-router``): a frozen dataclass and its CLI parser.

The command line is parsed once into :class:`RouterConfig`; every value is validated there so that
the router itself never sees a malformed backend. Bad input raises :class:`ValueError` with a
message naming the offending option (the CLI turns it into ``SystemExit(2)`` via argparse).

Prefill backends are given as ``URL,kv=HOST:PORT[,engine_id=ID][,tp=N][,pp=N]``:

* ``URL`` -- the prefill vLLM server's HTTP base URL (``http://p0:8100``).
* ``kv`` -- host:port of that server's KV side channel (the connector's handshake listener).
  Required in ``push`` and ``upstream-push`` modes; unused (so optional) in ``pull`` mode, where
  P reports its own coordinates in its response.
* ``engine_id``, ``tp``, ``pp`` -- only for ``upstream-push``: P's NIXL engine id and parallel
  sizes. Without them the router learns them from P's responses (see ``docs/router.md``).
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

MODES = ("push", "pull", "upstream-push")


def _parse_url(url: str, what: str) -> str:
    """Check an ``http(s)://host[:port][/prefix]`` base URL; return it without a trailing ``/``."""
    url = url.strip()
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError on a non-numeric or out-of-range port
    except ValueError as exc:
        raise ValueError(f"{what}: invalid URL {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what}: expected an http(s)://HOST[:PORT] URL, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"{what}: URL {url!r} must not carry a query or fragment")
    del port
    return url.rstrip("/")


def _parse_hostport(value: str, what: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (``[v6addr]:PORT`` for IPv6)."""
    host, sep, port_s = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        raise ValueError(f"{what}: expected HOST:PORT, got {value!r}")
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"{what}: port must be an integer in 1..65535, got {port_s!r}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        try:  # what a socket does with it: a name with an empty or over-long label fails there
            host.encode("idna")
        except UnicodeError:
            raise ValueError(f"{what}: {host!r} is not a valid host name") from None
    return host, int(port_s)


def kv_mismatch(kv_host: str, kv_port: int | None, named: str) -> str | None:
    """Why ``named`` (``HOST:PORT`` a P's answer gives as its side channel) is not the
    ``kv=`` configured for it, or None when it may be: the ports differ, or both hosts are IP
    addresses and differ (a wildcard, or a host name, is not compared). A ``named`` that does
    not parse is not judged."""
    try:
        host, port = _parse_hostport(named, "side channel")
    except ValueError:
        return None
    if port != kv_port:
        return f"its side channel is at port {port} (its answer says), kv= here is {kv_port}"
    try:
        mine, theirs = (_plain(ipaddress.ip_address(h)) for h in (kv_host, host))
    except ValueError:
        return None
    if not (theirs.is_unspecified or mine.is_unspecified) and mine != theirs:
        return f"its side channel is at {named} (its answer says), kv= here is {kv_host}:{kv_port}"
    return None


def _plain(addr: ipaddress.IPv4Address | ipaddress.IPv6Address
           ) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IPv4-mapped IPv6 address as the IPv4 address it is."""
    mapped = getattr(addr, "ipv4_mapped", None)
    return mapped if mapped is not None else addr


def _positive_int(value: str, what: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{what}: expected a positive integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class PrefillSpec:
    """One prefill backend."""

    url: str
    kv_host: str | None = None
    kv_port: int | None = None
    engine_id: str | None = None  # upstream-push only; learned from P's responses when absent
    tp_size: int = 1
    pp_size: int = 1

    @property
    def kv(self) -> str | None:
        """``HOST:PORT`` of the side channel, or ``None`` when not configured."""
        return None if self.kv_host is None else f"{self.kv_host}:{self.kv_port}"


def parse_prefill_spec(spec: str) -> PrefillSpec:
    """Parse ``URL,kv=HOST:PORT[,engine_id=ID][,tp=N][,pp=N]`` into a :class:`PrefillSpec`."""
    what = f"--prefill {spec!r}"
    url_part, *options = [p.strip() for p in spec.split(",")]
    url = _parse_url(url_part, what)
    fields: dict[str, object] = {}
    for opt in options:
        key, sep, value = opt.partition("=")
        if not sep or not value:
            raise ValueError(f"{what}: expected KEY=VALUE after the URL, got {opt!r}")
        if key in fields or (key == "kv" and "kv_host" in fields):
            raise ValueError(f"{what}: option {key!r} given twice")
        if key == "kv":
            fields["kv_host"], fields["kv_port"] = _parse_hostport(value, f"{what} kv")
        elif key == "engine_id":
            fields["engine_id"] = value
        elif key in ("tp", "pp"):
            fields[f"{key}_size"] = _positive_int(value, f"{what} {key}")
        else:
            raise ValueError(f"{what}: unknown option {key!r} (known: kv, engine_id, tp, pp)")
    return PrefillSpec(url=url, **fields)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs; immutable after parsing."""

    prefill: tuple[PrefillSpec, ...]
    decode: tuple[str, ...]
    mode: str = "push"
    host: str = "127.0.0.1"
    port: int = 8000
    timeout: float = 300.0  # upstream requests: read time-out and pool wait, seconds
    connect_timeout: float = 10.0
    max_connections: int = 1024  # size of each upstream connection pool (legs; probes)
    health_probe_timeout: float = 2.0
    #: (push) bound of each socket operation of a release to a P side channel, seconds
    release_timeout: float = 5.0
    #: (push, streaming) send the client P's first token as soon as P has it, then D's stream
    #: without its copy of it (``first_token``): "auto" where it is provably the same token
    #: (greedy, one choice, ...), "off" never (the default: opt in, docs/router.md says why)
    first_token_from_prefill: str = "off"
    #: seconds an idle connection to a backend is kept for the next leg: under the servers'
    #: own HTTP keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default), so that a leg
    #: is never sent on a connection the server is closing at that moment
    keepalive: float = 4.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.prefill:
            raise ValueError("at least one --prefill URL,kv=HOST:PORT is required")
        if not self.decode:
            raise ValueError("at least one --decode URL is required")
        if self.mode != "pull":
            missing = [p.url for p in self.prefill if p.kv_host is None]
            if missing:
                raise ValueError(
                    f"--mode {self.mode} needs kv=HOST:PORT on every --prefill; missing on "
                    + ", ".join(missing)
                )
        urls = [p.url for p in self.prefill] + list(self.decode)
        dupes = sorted({u for u in urls if urls.count(u) > 1})
        if dupes:
            raise ValueError(f"backend URL given more than once: {', '.join(dupes)}")
        kvs = [p.kv for p in self.prefill if p.kv is not None]
        dupes = sorted({k for k in kvs if kvs.count(k) > 1})
        if dupes and self.mode != "pull":
            # one side channel is one P: D would register a transfer of the other P's there,
            # which never pairs (D waits transfer_timeout_s, then a bare 500)
            users = {k: ", ".join(p.url for p in self.prefill if p.kv == k) for k in dupes}
            raise ValueError("kv= side channel given for more than one --prefill: "
                             + ", ".join(f"{k} ({users[k]})" for k in dupes))
        if not self.timeout > 0 or not self.connect_timeout > 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout}")
        if not self.release_timeout > 0:
            raise ValueError(f"--release-timeout must be > 0, got {self.release_timeout}")
        if not self.health_probe_timeout > 0:
            raise ValueError(f"health_probe_timeout must be > 0, got {self.health_probe_timeout}")
        if self.first_token_from_prefill not in ("auto", "off"):
            raise ValueError("--first-token-from-prefill must be auto or off, got "
                             f"{self.first_token_from_prefill!r}")
        if not self.keepalive > 0:
            raise ValueError(f"--keepalive must be > 0, got {self.keepalive}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kv-push-router",
        description="OpenAI-compatible router in front of prefill (P) and decode (D) vLLM servers.",
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default %(default)s)")
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL,kv=HOST:PORT",
        help="prefill server and its KV side channel (repeatable); "
        "optional extra fields engine_id=ID,tp=N,pp=N for --mode upstream-push",
    )
    p.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="decode server (repeatable)"
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="push",
        help="push: our connector, P and D legs concurrently; pull: vLLM NixlConnector, serial; "
        "upstream-push: vLLM NixlPushConnector (default %(default)s)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="upstream read timeout, s (%(default)s)"
    )
    p.add_argument("--max-connections", type=int, default=1024, help="upstream connection pool")
    p.add_argument(
        "--release-timeout", type=float, default=5.0,
        help="push: time-out of each step of releasing P's prefill of an exchange that ended "
        "without decode output, s (%(default)s)")
    p.add_argument(
        "--first-token-from-prefill", choices=("auto", "off"), default="off",
        help="push, streaming requests: stream P's first token to the client as soon as P has "
        "it, then D's stream without its copy; auto: only where it is provably the same token "
        "(greedy, one choice, no logprobs, stop strings or echo); a rare mismatch of P's and "
        "D's token ends that stream with an error (docs/router.md) (%(default)s)")
    p.add_argument(
        "--keepalive", type=float, default=4.0,
        help="seconds an idle connection to a backend is kept for the next leg; keep it under "
        "the servers' own keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default) "
        "(%(default)s)")
    p.add_argument("--log-level", default="info", help="uvicorn/router log level")
    return p


def parse_args(argv: Sequence[str] | None = None) -> tuple[RouterConfig, str]:
    """Parse the command line into a :class:`RouterConfig` (and the log level).

    Invalid values end the program through ``parser.error`` (``SystemExit(2)``) with a message.
    """
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        config = RouterConfig(
            prefill=tuple(parse_prefill_spec(s) for s in ns.prefill),
            decode=tuple(_parse_url(u, f"--decode {u!r}") for u in ns.decode),
            mode=ns.mode,
            host=ns.host,
            port=ns.port,
            timeout=ns.timeout,
            connect_timeout=min(10.0, ns.timeout),
            max_connections=ns.max_connections,
            release_timeout=ns.release_timeout,
            first_token_from_prefill=ns.first_token_from_prefill,
            keepalive=ns.keepalive,
        )
    except ValueError as exc:
        parser.error(str(exc))  # exits
    return config, ns.log_level

