"""Wire messages between producer (P) and decoder (D) workers.

Every control message travels as a NIXL notification (the completion notice rides the WRITE it
completes); the handshake travels over the side channel. All are msgspec structs in one tagged
union, framed by ``Envelope`` which carries the protocol version, a sequence number and, when a
shared secret is configured, an HMAC-SHA256.

Authentication (with a secret): the MAC covers the version, the ``Route`` (sender and receiver
agent names; empty for side-channel frames, so a frame of one kind never verifies as the other),
the sequence number and the body. ``auth.NotificationChannel`` numbers each (sender, receiver)
pair's notifications and rejects replays; the handshake binds its frames with fresh nonces
(``Challenge`` -> ``Hello.reply_to`` -> ``Welcome.reply_to``). A receiver without a secret
refuses MAC'd frames (``secret_mismatch``): a secret set on one side only is a configuration
error, never silently ignored.

Decoding never raises anything but ``MessageRejected``: bad bytes, a wrong version, a missing or
wrong MAC and an unknown tag all become a typed rejection with a ``reason`` label that metrics
count.

Protocol versions (bump on any change to the structs below; ``COMPAT_HASH`` changes with them):
  1 -- Hello/Welcome/Refused handshake, Register, WriteDone, Cancel, CancelAck, TransferFailed,
       Heartbeat, Goodbye.
  2 -- Hello and Welcome carry the sender's NIXL version (``nixl_version``); a peer on a NIXL
       release that cannot be paired with ours is refused at the handshake (``nixl_compat``);
       handshake opens with the producer's ``Challenge``; Hello and Welcome carry nonces
       (``nonce``, ``reply_to``); ``Envelope`` carries a sequence number; the MAC binds sender,
       receiver and sequence; a receiver without a secret refuses MAC'd frames;
       transfer identity per engine request: ``Register`` carries ``reg_id`` (the decoder's engine
       request id; attempts of one request share it) and ``prompt_digest`` (the rendezvous key is
       transfer id + digest); ``WriteDone``, ``Cancel``, ``CancelAck`` and ``TransferFailed``
       carry ``reg_id``; ``CancelAck`` and ``TransferFailed`` carry ``chunks_done``, the number of
       WRITE chunks of that attempt whose ``WriteDone`` the decoder must still see before it may
       release the blocks.
  3 -- staged transfers: Hello.staging (D's registered staging region), Welcome.staging (P can
       stage), Register.slot (D's slot for this registration), WriteDone.staged/layer_lo/layer_hi
       (a staged chunk and the layers it holds; staged notices carry ``reg_id`` and count in
       ``chunks_done`` like region notices). All optional: a side that does not stage leaves
       them at their defaults and the other side takes the region path.
  4 -- the router's release: ``Release`` (router -> producer, over the side channel, answering
       the producer's ``Challenge`` in ``reply_to``: the transfer ids whose exchange ended
       without decode output) and ``ReleaseAck`` (producer -> router: accepted, and every
       producer rank's side-channel port, so the router tells each rank).
  5 -- ``TransferFailed.abandoned``: the transfer was not made because its request ended first
       (vLLM aborted P's request; the router released the transfer), no failure; one of
       ``ABANDONED`` (a literal type: another value does not decode). Only a default was added,
       but the compatibility hash changes with it, so P and D of before and after refuse each
       other at the handshake: upgrade both together.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import re
from typing import Literal, NamedTuple, Union

import msgspec

from .geometry import KVGeometry

PROTOCOL_VERSION = 5


class StagingRegion(msgspec.Struct, frozen=True, kw_only=True):
    """D's staging pool as registered with its NIXL agent (same memory type and device as its
    KV): slots are ``(offset, length)`` inside ``[base, base + length)``."""

    base: int
    length: int


class Slot(msgspec.Struct, frozen=True, kw_only=True):
    """Where a staged registration's KV goes in D's staging region: ``length`` bytes at
    ``offset`` from its base, laid out by ``staging.slot_layout`` and cut into chunks of
    ``layers_per_chunk`` layers (``SlotLayout.chunks``), one WRITE and one notice each."""

    offset: int
    length: int
    layers_per_chunk: int

#: longest ``reg_id`` / ``prompt_digest`` / released transfer id accepted on the wire
MAX_ID_CHARS = 256
#: what :func:`wire_id` puts before the digest of an id too long for the wire
WIRE_ID_DIGEST = "sha256:"


def wire_id(ident: str) -> str:
    """``ident`` as a registration or transfer id on the wire: itself where it fits
    :data:`MAX_ID_CHARS`, else ``sha256:`` and its digest (71 characters). An engine request id
    grows past the limit from a long client ``X-Request-Id`` (vLLM adds its prefix, index and
    random suffix), so D registers under this and the upstream form's transfer id is this:
    both ends derive it alike, and such a request keeps its KV transfer. A request id holding
    lone surrogates (a header that was not UTF-8) is digested as its code points are."""
    if len(ident) <= MAX_ID_CHARS:
        return ident
    return WIRE_ID_DIGEST + hashlib.sha256(ident.encode("utf-8", "surrogatepass")).hexdigest()

#: most transfer ids one ``Release`` may name
MAX_RELEASE_IDS = 1024

class Challenge(msgspec.Struct, tag="challenge", frozen=True, kw_only=True):
    """P worker -> D worker (side channel, first frame): a fresh nonce the Hello must answer."""

    nonce: bytes


class Hello(msgspec.Struct, tag="hello", frozen=True, kw_only=True):
    """D worker -> P worker (side channel): who I am, how to reach me, where my KV lives.

    ``agent_name`` must be the name NIXL reports for ``agent_metadata`` (checked on load).
    ``reply_to`` is the producer's ``Challenge.nonce`` on this connection; ``nonce`` is fresh
    and comes back in ``Welcome.reply_to`` (the side channel fills both).
    ``staging``: my staging region, when I can receive staged transfers."""

    engine_id: str
    agent_name: str
    agent_metadata: bytes
    geometry: KVGeometry
    compat_hash: str
    nixl_version: str = ""  # the sender's NIXL release; "" when it has none installed
    nonce: bytes = b""
    reply_to: bytes = b""
    staging: StagingRegion | None = None


class Welcome(msgspec.Struct, tag="welcome", frozen=True, kw_only=True):
    """P worker -> D worker (side channel reply)."""

    engine_id: str
    agent_name: str
    agent_metadata: bytes
    geometry: KVGeometry
    compat_hash: str
    side_channel_ports: tuple[int, ...]  # one per P TP rank, rank order
    nixl_version: str = ""  # the sender's NIXL release; "" when it has none installed
    reply_to: bytes = b""  # the Hello's nonce (filled by the side channel)
    staging: bool = False  # P can pack registrations that carry a slot (it has a staging pool)


class Refused(msgspec.Struct, tag="refused", frozen=True, kw_only=True):
    """P worker -> D worker (side channel reply): the handshake is refused, and why."""

    reason: str


class Release(msgspec.Struct, tag="release", frozen=True, kw_only=True):
    """Router -> P worker (side channel, answering the producer's ``Challenge``): the exchanges
    of these transfer ids ended without decode output (client gone before D's first byte, D
    failed, P's leg failed), so no decoder will claim their prefills: free what no decoder has
    claimed, and refuse registrations that come later.

    ``reply_to`` is the producer's ``Challenge.nonce`` on this connection: with a secret the MAC
    binds it, so a recorded Release never works again. One Release per connection."""

    transfer_ids: tuple[str, ...]
    reply_to: bytes = b""


class ReleaseAck(msgspec.Struct, tag="release_ack", frozen=True, kw_only=True):
    """P worker -> router: the Release was authenticated and handed to the transfer thread
    (``accepted`` transfer ids); ``side_channel_ports``: every producer rank's port, rank order
    (each rank holds its own copy of a prefill: the router tells the others too)."""

    accepted: int
    side_channel_ports: tuple[int, ...]


class Register(msgspec.Struct, tag="reg", frozen=True, kw_only=True):
    """D -> P: write the prompt's KV for ``transfer_id`` into these blocks of mine.

    One client request may become several engine requests that share ``transfer_id`` (a prompt
    list, ``n > 1``): the producer pairs a registration with a prefill of the same
    ``(transfer_id, prompt_digest)`` (a digest of the prompt's token ids), and ``reg_id`` (the
    decoder's engine request id, unique per decoder engine) tells that request's registrations
    apart; a re-issued request keeps its ``reg_id`` and raises ``attempt``.

    ``block_ids[j]`` holds tokens ``first_token + j * block_size`` onward (D's block size);
    tokens below ``first_token`` D already has (its own prefix cache). ``geometry_digest`` names
    the geometry D sent in its Hello, so a registration can never be mapped with a stale layout.
    ``slot``: D reserved a slot of its staging region for this registration; P may pack its KV
    and WRITE it there instead of into the blocks (the region path stays valid: P takes it when
    it cannot stage).
    """

    transfer_id: str
    reg_id: str
    prompt_digest: str
    attempt: int
    engine_id: str
    tp_rank: int
    block_ids: tuple[int, ...]
    first_token: int
    num_tokens: int
    geometry_digest: str
    slot: Slot | None = None


class WriteDone(msgspec.Struct, tag="done", frozen=True, kw_only=True):
    """P -> D, carried by each WRITE of a transfer: chunk ``chunk`` of ``chunks`` is written.

    A producer posts a long transfer in bounded chunks; the decoder has the KV of that producer
    rank once it has seen all ``chunks`` notices. ``staged``: the chunk went into D's slot (not
    its blocks) and holds layers ``[layer_lo, layer_hi)`` of this rank's sub-slice; D unpacks it
    and has the KV once every chunk is unpacked."""

    transfer_id: str
    reg_id: str
    attempt: int
    engine_id: str
    tp_rank: int
    num_bytes: int
    chunk: int = 0
    chunks: int = 1
    staged: bool = False
    layer_lo: int = 0
    layer_hi: int = 0


class Cancel(msgspec.Struct, tag="cancel", frozen=True, kw_only=True):
    """D -> P: do not write into this registration's blocks (D aborted or no longer needs them).

    The decoder re-sends it (with back-off) until acknowledged; the producer answers every copy.
    ``prompt_digest`` lets a producer that never saw the registration (lost, or still on its
    way) account for the request all the same."""

    transfer_id: str
    reg_id: str
    prompt_digest: str
    attempt: int
    engine_id: str
    tp_rank: int
    reason: str


class CancelAck(msgspec.Struct, tag="cancel_ack", frozen=True, kw_only=True):
    """P -> D: no WRITE into that registration is in flight or will ever be issued.

    ``chunks_done`` WRITE chunks of that attempt completed before: their ``WriteDone`` notices
    may still be on their way (a local DONE does not prove remote delivery on every transport),
    so the decoder keeps the blocks until it has seen that many."""

    transfer_id: str
    reg_id: str
    attempt: int
    engine_id: str
    tp_rank: int
    chunks_done: int = 0


#: values of ``TransferFailed.abandoned`` other than "" (they become metric labels); keep in step
#: with ``Abandoned``, whose literal values enter the compatibility hash
ABANDONED = ("prefill_aborted", "router_release")
Abandoned = Literal["", "prefill_aborted", "router_release"]


class TransferFailed(msgspec.Struct, tag="failed", frozen=True, kw_only=True):
    """P -> D: the transfer cannot complete (WRITE not posted or failed, bad registration).

    Sent only once no WRITE chunk of that attempt is in flight; ``chunks_done`` as in
    ``CancelAck``."""

    transfer_id: str
    reg_id: str
    attempt: int
    engine_id: str
    tp_rank: int
    reason: str
    chunks_done: int = 0
    #: not a failure but an abandonment: ``prefill_aborted`` (P's request was aborted: its
    #: client hung up or the router closed P's leg) or ``router_release`` (the router ended the
    #: exchange); empty for a failure. Counted as ``transfers_abandoned{reason}`` on both sides
    #: instead of ``transfers_failed``; any other value does not decode (``malformed``)
    abandoned: Abandoned = ""


class Heartbeat(msgspec.Struct, tag="hb", frozen=True, kw_only=True):
    engine_id: str
    tp_rank: int
    seq: int


class Goodbye(msgspec.Struct, tag="bye", frozen=True, kw_only=True):
    """Either side, on orderly close: forget me now rather than at the liveness timeout."""

    engine_id: str
    tp_rank: int


Message = Union[
    Challenge, Hello, Welcome, Refused, Register, WriteDone, Cancel, CancelAck, TransferFailed,
    Heartbeat, Goodbye, Release, ReleaseAck
]


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    version: int
    body: bytes
    mac: bytes = b""
    seq: int = 0  # per (sender, receiver) on NIXL notifications; 0 on side-channel frames


class Route(NamedTuple):
    """Who sends a NIXL notification to whom (agent names), bound into its MAC."""

    sender: str
    receiver: str


#: side-channel frames: no agent names yet (a notification's route never has empty names)
NO_ROUTE = Route("", "")


class MessageRejected(ValueError):
    """A message that must not be acted on. ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


_CLASS_REPR = re.compile(r"<class '(?:\w+\.)*(\w+)'>")


def _class_name(m: re.Match) -> str:
    return m.group(1)


#: how ``prompt_digest`` encodes the token ids (part of the compatibility hash: two workers
#: that digest prompts differently would never pair and are refused at the handshake)
PROMPT_DIGEST_SCHEME = "blake2b-64(pickle-5(list[int]))"


def prompt_digest(token_ids) -> str:
    """A short digest of a prompt's token ids: what P and D both know one prompt by
    (``Register.prompt_digest``). ``""`` when the request has no token ids (prompt embeddings):
    such prompts of one transfer then pool together.

    The ids are pickled as a list of ints (protocol 5 is a specified, deterministic encoding,
    the same on every platform and Python): cheaper than packing them into an int64 array
    first (0.2-0.8x of its time, ``benchmarks/bench_prompt_digest.py``); it runs on vLLM's
    scheduler thread once per request."""
    if token_ids is None:
        return ""
    ids = token_ids if type(token_ids) is list else (
        token_ids.tolist() if hasattr(token_ids, "tolist") else [int(t) for t in token_ids])
    return hashlib.blake2b(pickle.dumps(ids, protocol=5), digest_size=8).hexdigest()


def _compat_hash() -> str:
    parts = [str(PROTOCOL_VERSION), PROMPT_DIGEST_SCHEME]
    for cls in (KVGeometry, StagingRegion, Slot, *Message.__args__):  # type: ignore[attr-defined]
        info = msgspec.inspect.type_info(cls)
        # a nested struct's repr names its class by module path, which is not part of the wire
        # format (``kv_push.common.geometry`` installed, ``common.geometry`` from a checkout)
        fields = ",".join(f"{f.name}:{_CLASS_REPR.sub(_class_name, repr(f.type))}"
                          for f in info.fields)
        parts.append(f"{cls.__name__}[{getattr(info, 'tag', '')}]({fields})")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


COMPAT_HASH = _compat_hash()

_body_encoder = msgspec.msgpack.Encoder()
_body_decoder = msgspec.msgpack.Decoder(Message)
_env_decoder = msgspec.msgpack.Decoder(Envelope)

MAX_MESSAGE_BYTES = 1 << 20


class Codec:
    """Encodes and decodes framed messages; with ``secret`` every frame is authenticated.

    ``route`` and ``seq`` are bound into the MAC: a frame verifies only with the route and
    sequence number it was encoded with (side-channel frames use ``NO_ROUTE`` and 0). Replay
    checks on the sequence number are ``auth.NotificationChannel``'s job."""

    def __init__(self, secret: bytes | None = None):
        self._secret = secret or None

    @property
    def authenticated(self) -> bool:
        return self._secret is not None

    def __repr__(self) -> str:  # never the key
        return f"Codec(authenticated={self.authenticated})"

    def _mac(self, version: int, route: Route, seq: int, body: bytes) -> bytes:
        assert self._secret is not None
        head = _body_encoder.encode((version, route.sender, route.receiver, seq))
        return hmac.new(self._secret, head + body, hashlib.sha256).digest()

    def encode(self, msg: Message, route: Route = NO_ROUTE, seq: int = 0) -> bytes:
        body = _body_encoder.encode(msg)
        mac = self._mac(PROTOCOL_VERSION, route, seq, body) if self._secret else b""
        return _body_encoder.encode(Envelope(PROTOCOL_VERSION, body, mac, seq))

    def decode(self, data: bytes, route: Route = NO_ROUTE) -> Message:
        return self.decode_seq(data, route)[0]

    def decode_seq(self, data: bytes, route: Route = NO_ROUTE) -> tuple[Message, int]:
        """The message and its envelope's sequence number (authenticated with a secret)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MessageRejected("malformed", f"not bytes: {type(data).__name__}")
        if len(data) > MAX_MESSAGE_BYTES:
            raise MessageRejected("oversize", f"{len(data)} bytes")
        try:
            env = _env_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise MessageRejected("malformed", str(e)) from None
        if env.version != PROTOCOL_VERSION:
            raise MessageRejected(
                "version", f"peer speaks protocol {env.version}, we speak {PROTOCOL_VERSION}"
            )
        if self._secret is not None:
            if not env.mac:
                raise MessageRejected("unauthenticated", "message carries no MAC (the peer has "
                                      "no shared secret; set KV_PUSH_SECRET on both sides)")
            if not hmac.compare_digest(env.mac, self._mac(env.version, route, env.seq, env.body)):
                raise MessageRejected("bad_mac", "MAC does not match (another secret, or a "
                                      "frame replayed from another sender or receiver)")
        elif env.mac:
            raise MessageRejected("secret_mismatch", "the peer authenticates its messages with "
                                  "a shared secret and none is configured here; set "
                                  "KV_PUSH_SECRET on both sides or neither")
        try:
            msg = _body_decoder.decode(env.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise MessageRejected("malformed", str(e)) from None
        _check_sane(msg)
        return msg, env.seq


#: bytes of every handshake nonce
NONCE_BYTES = 16


def _check_sane(msg: Message) -> None:
    """Semantic checks that types alone cannot express."""
    if isinstance(msg, Challenge):
        if len(msg.nonce) != NONCE_BYTES:
            raise MessageRejected("invalid", f"challenge nonce of {len(msg.nonce)} bytes")
    if isinstance(msg, Release):
        if not 1 <= len(msg.transfer_ids) <= MAX_RELEASE_IDS:
            raise MessageRejected("invalid", f"release of {len(msg.transfer_ids)} transfer ids "
                                  f"(1 to {MAX_RELEASE_IDS})")
        if any(not t or len(t) > MAX_ID_CHARS for t in msg.transfer_ids):
            raise MessageRejected("invalid", "release: empty or over-long transfer id")
    if isinstance(msg, (Register, WriteDone, Cancel, CancelAck, TransferFailed)):
        if not msg.transfer_id or not msg.reg_id:
            raise MessageRejected("invalid", f"{type(msg).__name__}: empty transfer or reg id")
        if len(msg.reg_id) > MAX_ID_CHARS or msg.attempt < 0:
            raise MessageRejected("invalid", f"{type(msg).__name__}: reg id or attempt")
    if isinstance(msg, (Register, Cancel)) and len(msg.prompt_digest) > MAX_ID_CHARS:
        raise MessageRejected("invalid", "prompt digest too long")
    if isinstance(msg, Register):
        if msg.first_token < 0 or msg.num_tokens < msg.first_token:
            raise MessageRejected("invalid", f"registration token range {msg!r}")
        if any(b < 0 for b in msg.block_ids):
            raise MessageRejected("invalid", "negative block id")
        s = msg.slot
        if s is not None and (s.offset < 0 or s.length <= 0 or s.layers_per_chunk < 1):
            raise MessageRejected("invalid", f"registration slot {s!r}")
    elif isinstance(msg, WriteDone):
        if msg.chunks < 1 or not 0 <= msg.chunk < msg.chunks or msg.num_bytes < 0:
            raise MessageRejected("invalid", f"write notice chunk {msg.chunk} of {msg.chunks}")
        if msg.staged and not 0 <= msg.layer_lo < msg.layer_hi:
            raise MessageRejected("invalid", f"staged notice layers [{msg.layer_lo}, "
                                  f"{msg.layer_hi})")
    elif isinstance(msg, (CancelAck, TransferFailed)):
        if msg.chunks_done < 0:
            raise MessageRejected("invalid", f"negative chunks_done {msg.chunks_done}")
    elif isinstance(msg, (Hello, Welcome)):
        try:
            msg.geometry.validate()
        except ValueError as e:
            raise MessageRejected("invalid", f"geometry: {e}") from None
        if isinstance(msg, Hello) and msg.staging is not None and (
                msg.staging.base <= 0 or msg.staging.length <= 0):
            raise MessageRejected("invalid", f"staging region {msg.staging!r}")


def peek_kind(data: bytes) -> str:
    """The tag a frame's body claims (``"release"``, ``"hello"``...), without authenticating or
    validating anything; ``""`` when it cannot be read. Only to label a rejection (which
    counter, which log line): never act on it."""
    try:
        env = _env_decoder.decode(data)
        body = msgspec.msgpack.decode(env.body)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError):
        return ""
    kind = body.get("type") if isinstance(body, dict) else None
    return kind if isinstance(kind, str) else ""


def unverified_challenge(data: bytes) -> Challenge | None:
    """The ``Challenge`` a frame carries, without checking its MAC; None when it is none. For
    the router only, when the producer's frames cannot be authenticated here (a secret on one
    side, or two secrets): it still answers the nonce, so that the producer judges the Release
    and counts why it refused it. A nonce is no secret, and nothing acts on it but that reply."""
    try:
        env = _env_decoder.decode(data)
        msg = msgspec.msgpack.decode(env.body, type=Challenge)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return msg if len(msg.nonce) == NONCE_BYTES else None


def geometry_digest(geometry: KVGeometry) -> str:
    return hashlib.sha256(_body_encoder.encode(geometry)).hexdigest()[:16]
