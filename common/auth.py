"""Who may tell a worker what: the shared secret, router-signed transfer parameters, and replay
protection of control notifications.

The threat this guards against: the side channel hands out NIXL agent metadata (remote keys to
the whole KV cache), a decoder dials whatever ``remote_host:remote_port`` its request names, and
control notifications (``Goodbye``, ``Cancel``, ``Register``...) make a worker drop peers or hold
blocks. With a shared secret (``KV_PUSH_SECRET``, or a file named by ``secret_file`` /
``KV_PUSH_SECRET_FILE``; the same on every P, D and router):

* **Transfer parameters** -- the router signs each leg's ``kv_transfer_params``
  (``TransferParamsSigner.sign``): an HMAC-SHA256 over a canonical encoding of transfer id, both
  direction flags, remote host and port, and an expiry time, under the key ``kv_push_sig``. The
  connector's scheduler half (``connector_scheduler.TransferParams.parse``) acts on them only with
  a valid, unexpired signature (``verify_transfer_params``); a client that reaches P or D directly
  cannot make D dial a host of its choosing or make P hold blocks.
* **Notifications** -- ``NotificationChannel`` numbers each (sender, receiver) pair's messages;
  the MAC binds both agent names and the number (``messages.Codec``), and the receiver keeps a
  sliding window per sender (``ReplayWindow``): a recorded message is rejected when replayed,
  reordering within ``REPLAY_WINDOW`` is tolerated. Sequence numbers start at the wall clock in
  microseconds, so a restarted process (or a counter forgotten after ``max_pairs`` other peers)
  starts above every number it used before.
* **Router releases** -- the router's ``Release`` frames (``side_channel.release``) carry its
  HMAC under the same key, bound to the producer's challenge nonce: not replayable.
* **Handshake** -- nonces (``side_channel``) and the agent-name check on loading metadata
  (``TransferThread.add_peer``) live with the code they guard.

Without a secret nothing is authenticated: keep the side channel and the engines' HTTP ports
unreachable from outside the cluster (README, "Security"). Nothing here logs or formats a key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import time
from collections import OrderedDict
from typing import Any, Callable, Mapping

from .messages import Codec, Message, MessageRejected, Route

#: environment variables the secret is read from (never from kv_connector_extra_config)
SECRET_ENV = "KV_PUSH_SECRET"
SECRET_FILE_ENV = "KV_PUSH_SECRET_FILE"
#: key of the router's signature in kv_transfer_params
SIG_KEY = "kv_push_sig"
#: how long a signed kv_transfer_params stays valid (requests may queue on P or D before the
#: scheduler looks at them; the verdict is taken once, at that first look)
DEFAULT_PARAMS_TTL_S = 600.0
PARAMS_TTL_ENV = "KV_PUSH_PARAMS_TTL_S"
#: how far behind the newest sequence number a notification may arrive and still be accepted
#: (notifications that ride WRITEs arrive when the WRITE completes, so they may be overtaken by
#: everything the sender sent to that receiver meanwhile)
REPLAY_WINDOW = 1 << 14

_PARAMS_DOMAIN = "kv-push/transfer-params/1"


class SecretError(ValueError):
    pass


def load_secret(env: Mapping[str, str] | None = None, secret_file: str = "") -> bytes:
    """The shared secret: ``KV_PUSH_SECRET``, or the contents of ``secret_file`` (or the file
    named by ``KV_PUSH_SECRET_FILE``) without trailing newlines; ``b""`` when none is set.
    Raises ``SecretError`` (never quoting the key) when both are set or the file is unusable."""
    env = os.environ if env is None else env
    value = env.get(SECRET_ENV, "")
    path = secret_file or env.get(SECRET_FILE_ENV, "")
    if value and path:
        raise SecretError(f"both {SECRET_ENV} and a secret file ({path}) are set; use one")
    if not path:
        return value.encode()
    try:
        with open(path, "rb") as f:
            data = f.read().rstrip(b"\r\n")
    except OSError as e:
        raise SecretError(f"cannot read the secret file {path}: {e.strerror or e}") from None
    if not data:
        raise SecretError(f"the secret file {path} is empty")
    return data


# -- router-signed kv_transfer_params -----------------------------------------------------------


class ParamsSignatureError(ValueError):
    """``reason``: unsigned_transfer_params | bad_transfer_params_signature |
    expired_transfer_params (the metrics label)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def _params_mac(secret: bytes, *, transfer_id: str, do_remote_decode: bool,
                do_remote_prefill: bool, remote_host: str, remote_port: int, fanout: int,
                expires: int) -> str:
    canonical = json.dumps(
        [_PARAMS_DOMAIN, transfer_id, bool(do_remote_decode), bool(do_remote_prefill),
         remote_host, int(remote_port), int(fanout), int(expires)],
        separators=(",", ":"), ensure_ascii=True)
    return hmac.new(secret, canonical.encode(), hashlib.sha256).hexdigest()


def verify_transfer_params(sig: Any, secret: bytes, *, transfer_id: str, do_remote_decode: bool,
                           do_remote_prefill: bool, remote_host: str, remote_port: int,
                           now: float, fanout: int = 1) -> None:
    """Check ``sig`` (the value under ``SIG_KEY``) against the parsed parameters. Raises
    ``ParamsSignatureError``; returns None when the signature is valid and unexpired."""
    if sig is None:
        raise ParamsSignatureError("unsigned_transfer_params",
                                   f"kv_transfer_params carry no {SIG_KEY} (not from the router)")
    if (not isinstance(sig, dict) or not isinstance(sig.get("mac"), str)
            or not isinstance(sig.get("expires"), int) or isinstance(sig.get("expires"), bool)):
        raise ParamsSignatureError("bad_transfer_params_signature",
                                   f"{SIG_KEY} must be {{'expires': int, 'mac': hex}}")
    want = _params_mac(secret, transfer_id=transfer_id, do_remote_decode=do_remote_decode,
                       do_remote_prefill=do_remote_prefill, remote_host=remote_host,
                       remote_port=remote_port, fanout=fanout, expires=sig["expires"])
    if not hmac.compare_digest(sig["mac"].encode(), want.encode()):
        raise ParamsSignatureError("bad_transfer_params_signature",
                                   "signature does not match (another secret, or parameters "
                                   "changed after signing)")
    if now > sig["expires"]:
        raise ParamsSignatureError("expired_transfer_params",
                                   f"signature expired {now - sig['expires']:.0f}s ago")


class TransferParamsSigner:
    """The router's half: ``sign(params)`` returns the params with ``SIG_KEY`` added (a copy;
    unchanged without a secret)."""

    def __init__(self, secret: bytes = b"", ttl_s: float = DEFAULT_PARAMS_TTL_S,
                 clock: Callable[[], float] = time.time):
        if not ttl_s > 0:
            raise SecretError(f"transfer params TTL must be positive, got {ttl_s!r}")
        self._secret = bytes(secret)
        self.ttl_s = float(ttl_s)
        self._clock = clock

    def __repr__(self) -> str:  # never the key
        return f"TransferParamsSigner(enabled={self.enabled}, ttl_s={self.ttl_s})"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "TransferParamsSigner":
        """``KV_PUSH_SECRET`` / ``KV_PUSH_SECRET_FILE``, and ``KV_PUSH_PARAMS_TTL_S``."""
        env = os.environ if env is None else env
        raw_ttl = env.get(PARAMS_TTL_ENV, "")
        try:
            ttl = float(raw_ttl) if raw_ttl else DEFAULT_PARAMS_TTL_S
        except ValueError:
            raise SecretError(f"{PARAMS_TTL_ENV} must be a number of seconds, "
                              f"got {raw_ttl!r}") from None
        return cls(load_secret(env), ttl)

    @property
    def enabled(self) -> bool:
        return bool(self._secret)

    def codec(self) -> Codec:
        """A frame codec under the same key (the router's ``Release`` frames to producers)."""
        return Codec(self._secret or None)

    def sign(self, params: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(params)
        if not self._secret:
            return out
        expires = math.ceil(self._clock() + self.ttl_s)
        out[SIG_KEY] = {"expires": expires, "mac": _params_mac(
            self._secret, transfer_id=str(params["transfer_id"]),
            do_remote_decode=bool(params.get("do_remote_decode")),
            do_remote_prefill=bool(params.get("do_remote_prefill")),
            remote_host=str(params.get("remote_host") or ""),
            remote_port=int(params.get("remote_port") or 0),
            fanout=int(params.get("fanout") or 1), expires=expires)}
        return out


# -- replay protection of notifications -----------------------------------------------------------


class ReplayWindow:
    """The sequence numbers seen from one sender: the newest and a bitmap of the ``size`` below
    it. ``mark`` accepts each number once, in any order within the window."""

    def __init__(self, size: int = REPLAY_WINDOW):  # noqa: B008 - a constant
        self.size = size
        self.top = 0
        self._mask = 0  # bit i: top - i was seen
        self._full = (1 << size) - 1

    def mark(self, seq: int) -> None:
        """Accept ``seq`` or raise ``MessageRejected("replay")``."""
        if seq <= 0:
            raise MessageRejected("replay", f"sequence number {seq} (unsequenced frame)")
        if seq > self.top:
            shift = seq - self.top
            self._mask = ((self._mask << shift) | 1) & self._full if shift < self.size else 1
            self.top = seq
            return
        age = self.top - seq
        if age >= self.size:
            raise MessageRejected("replay", f"sequence number {seq} is more than {self.size} "
                                  f"behind the newest ({self.top})")
        bit = 1 << age
        if self._mask & bit:
            raise MessageRejected("replay", f"sequence number {seq} was already received")
        self._mask |= bit


class NotificationChannel:
    """Seals and opens one agent's NIXL notifications (owner thread only).

    ``seal(receiver, msg)`` numbers the message for that receiver and binds route and number into
    the MAC; ``open(sender, data)`` verifies them and, with a secret, rejects a number already
    seen from that sender (``replay``). Without a secret nothing can be authenticated, so nothing
    is checked beyond the frame itself. At most ``max_pairs`` counters and windows are kept (the
    least recently used go first)."""

    def __init__(self, codec: Codec, agent_name: str, *, window: int | None = None,
                 max_pairs: int = 1 << 16, clock: Callable[[], float] = time.time):
        self.codec = codec
        self.agent_name = agent_name
        self._window = window or REPLAY_WINDOW
        self._max_pairs = max_pairs
        self._clock = clock
        self._sent: OrderedDict[str, int] = OrderedDict()  # receiver -> last number sent
        self._seen: OrderedDict[str, ReplayWindow] = OrderedDict()  # sender -> window

    def _touch(self, book: OrderedDict, key: str) -> None:
        book.move_to_end(key)
        while len(book) > self._max_pairs:
            book.popitem(last=False)

    def seal(self, receiver: str, msg: Message) -> bytes:
        seq = self._sent.get(receiver)
        seq = (int(self._clock() * 1e6) if seq is None else seq) + 1
        self._sent[receiver] = seq
        self._touch(self._sent, receiver)
        return self.codec.encode(msg, Route(self.agent_name, receiver), seq)

    def open(self, sender: str, data: bytes) -> Message:
        msg, seq = self.codec.decode_seq(data, Route(sender, self.agent_name))
        if self.codec.authenticated:
            window = self._seen.get(sender)
            if window is None:
                window = self._seen[sender] = ReplayWindow(self._window)
            self._touch(self._seen, sender)
            window.mark(seq)
        return msg
