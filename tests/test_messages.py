"""Tests for kv_push.common.messages: framing, authentication, semantic checks, and a fuzz run.

The central property: ``Codec.decode`` either returns a message of a known type (which then
satisfies the semantic invariants) or raises ``MessageRejected`` with a known ``reason``; it
never raises anything else, whatever bytes arrive.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import re
import subprocess
import sys
import typing
import zlib
from pathlib import Path
from typing import Union

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_push.common import geometry as G
from kv_push.common import messages as M
from kv_push.common.geometry import KVGeometry
from kv_push.common.messages import (
    MAX_MESSAGE_BYTES,
    NO_ROUTE,
    PROTOCOL_VERSION,
    Cancel,
    CancelAck,
    Challenge,
    Codec,
    Envelope,
    Goodbye,
    Heartbeat,
    Hello,
    MessageRejected,
    Refused,
    Register,
    Release,
    ReleaseAck,
    Route,
    TransferFailed,
    Welcome,
    WriteDone,
    geometry_digest,
)

REPO = Path(__file__).resolve().parents[1]
SECRET = b"correct horse battery staple"
MESSAGE_TYPES = tuple(M.Message.__args__)  # type: ignore[attr-defined]
KNOWN_REASONS = {"malformed", "version", "unauthenticated", "bad_mac", "oversize", "invalid",
                 "secret_mismatch"}


def make_geometry(**overrides) -> KVGeometry:
    g = G.pooled(base=1 << 32, placement="kv_split", num_layers=2, num_kv_heads=4, head_size=8,
                 dtype_bytes=2, dtype="bfloat16", block_size=16, num_blocks=32, tp_size=2,
                 tp_rank=1)
    return msgspec.structs.replace(g, **overrides) if overrides else g


GEOM = make_geometry()
DIGEST = geometry_digest(GEOM)


def sample_messages() -> list[M.Message]:
    """One (or more) instance of every message type, with non-trivial field values."""
    return [
        Challenge(nonce=bytes(range(16))),
        Hello(engine_id="dec-0", agent_name="agent-d0", agent_metadata=b"\x00\x01meta\xff",
              geometry=GEOM, compat_hash=M.COMPAT_HASH, nonce=b"\x07" * 16,
              reply_to=bytes(range(16))),
        Welcome(engine_id="pre-0", agent_name="agent-p0", agent_metadata=b"\xfe" * 300,
                geometry=make_geometry(tp_rank=0, token_order="HND"), compat_hash=M.COMPAT_HASH,
                side_channel_ports=(5600, 5601), reply_to=b"\x07" * 16),
        Refused(reason="incompatible: geometry ünïcode"),
        Register(transfer_id="tid-1", reg_id="cmpl-7-0", prompt_digest="9f2a44c1d0e3b6a7",
                 attempt=3, engine_id="dec-0", tp_rank=1, block_ids=(7, 0, 31, 2),
                 first_token=16, num_tokens=70, geometry_digest=DIGEST),
        Register(transfer_id="t", reg_id="r", prompt_digest="", attempt=0, engine_id="",
                 tp_rank=0, block_ids=(), first_token=0, num_tokens=0, geometry_digest=""),
        WriteDone(transfer_id="tid-1", reg_id="cmpl-7-0", attempt=3, engine_id="pre-0",
                  tp_rank=0, num_bytes=1 << 40),
        # staged (protocol 3)
        Hello(engine_id="dec-0", agent_name="agent-d0", agent_metadata=b"m", geometry=GEOM,
              compat_hash=M.COMPAT_HASH, staging=M.StagingRegion(base=1 << 40, length=1 << 31)),
        Welcome(engine_id="pre-0", agent_name="agent-p0", agent_metadata=b"m", geometry=GEOM,
                compat_hash=M.COMPAT_HASH, side_channel_ports=(5600,), staging=True),
        Register(transfer_id="tid-2", reg_id="cmpl-8-0", prompt_digest="", attempt=0,
                 engine_id="dec-0", tp_rank=1, block_ids=(3,), first_token=0, num_tokens=9,
                 geometry_digest=DIGEST,
                 slot=M.Slot(offset=8192, length=4096, layers_per_chunk=2)),
        WriteDone(transfer_id="tid-2", reg_id="cmpl-8-0", attempt=0, engine_id="pre-0",
                  tp_rank=0, num_bytes=512, chunk=1, chunks=2, staged=True, layer_lo=2,
                  layer_hi=4),
        Cancel(transfer_id="tid-1", reg_id="cmpl-7-0", prompt_digest="9f2a", attempt=2,
               engine_id="dec-0", tp_rank=1, reason="aborted"),
        CancelAck(transfer_id="tid-1", reg_id="cmpl-7-0", attempt=2, engine_id="pre-0",
                  tp_rank=0, chunks_done=3),
        TransferFailed(transfer_id="tid-1", reg_id="1_cmpl-7", attempt=3, engine_id="pre-0",
                       tp_rank=0, reason="WRITE failed", chunks_done=0),
        Heartbeat(engine_id="pre-0", tp_rank=0, seq=2**63 - 1),
        Goodbye(engine_id="dec-0", tp_rank=1),
        # the router's release (protocol 4)
        Release(transfer_ids=("0123456789abcdef0123456789abcdef", "t" * M.MAX_ID_CHARS),
                reply_to=bytes(range(16))),
        Release(transfer_ids=tuple(f"tid-{i}" for i in range(M.MAX_RELEASE_IDS))),
        ReleaseAck(accepted=2, side_channel_ports=(5600, 5601, 5602, 5603)),
    ]


def test_samples_cover_every_message_type():
    assert {type(m) for m in sample_messages()} == set(MESSAGE_TYPES)
    assert len(MESSAGE_TYPES) == 13


def reason_of(codec: Codec, data, route: Route = NO_ROUTE) -> str:
    with pytest.raises(MessageRejected) as info:
        codec.decode(data, route)
    assert info.value.reason in KNOWN_REASONS
    return info.value.reason


def envelope(version: int, body: bytes, mac: bytes | None = None, seq: int | None = None
             ) -> bytes:
    fields = [version, body] if mac is None else [version, body, mac]
    if seq is not None:
        fields.append(seq)
    return msgspec.msgpack.encode(fields)


def body_of(msg) -> bytes:
    return msgspec.msgpack.encode(msg)


def mac_of(body: bytes, secret: bytes = SECRET, *, version: int = PROTOCOL_VERSION,
           route: tuple[str, str] = ("", ""), seq: int = 0) -> bytes:
    """The MAC, restated: HMAC-SHA256 over msgpack([version, sender, receiver, seq]) + body."""
    head = msgspec.msgpack.encode([version, route[0], route[1], seq])
    return hmac.new(secret, head + body, hashlib.sha256).digest()


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "hmac"])
@pytest.mark.parametrize("msg", sample_messages(), ids=lambda m: type(m).__name__)
def test_round_trip(msg, secret):
    codec = Codec(secret)
    assert codec.authenticated is (secret is not None)
    frame = codec.encode(msg)
    assert isinstance(frame, bytes)
    out = codec.decode(frame)
    assert type(out) is type(msg)
    assert out == msg
    # buffers other than bytes decode the same
    assert codec.decode(bytearray(frame)) == msg
    assert codec.decode(memoryview(frame)) == msg
    env = msgspec.msgpack.decode(frame, type=Envelope)
    assert env.version == PROTOCOL_VERSION
    assert env.mac == (mac_of(env.body) if secret else b"")


def test_empty_secret_means_unauthenticated():
    codec = Codec(b"")
    assert not codec.authenticated
    env = msgspec.msgpack.decode(codec.encode(sample_messages()[-1]), type=Envelope)
    assert env.mac == b""


def test_receiver_without_secret_refuses_maced_messages():
    """A secret set on one side only is an error on both sides, never silently ignored."""
    plain = Codec()
    for msg in sample_messages():
        assert reason_of(plain, Codec(SECRET).encode(msg)) == "secret_mismatch"
        assert reason_of(plain, Codec(SECRET).encode(msg, Route("a", "b"), 5)) == "secret_mismatch"


# -- route and sequence binding --------------------------------------------------------------------


def test_mac_binds_sender_receiver_and_sequence():
    codec = Codec(SECRET)
    ab = Route("agent-a", "agent-b")
    for msg in sample_messages():
        frame = codec.encode(msg, ab, 41)
        assert codec.decode_seq(frame, ab) == (msg, 41)
        env = msgspec.msgpack.decode(frame, type=Envelope)
        assert env.seq == 41 and env.mac == mac_of(env.body, route=ab, seq=41)
        # another sender, another receiver, the names swapped, or the side channel: bad MAC
        for other in (Route("agent-c", "agent-b"), Route("agent-a", "agent-c"),
                      Route("agent-b", "agent-a"), NO_ROUTE):
            assert reason_of(codec, frame, other) == "bad_mac"
        # the sequence number changed in transit
        forged = envelope(env.version, env.body, env.mac, seq=42)
        assert reason_of(codec, forged, ab) == "bad_mac"
    # a side-channel frame does not verify as a notification either
    side = codec.encode(Goodbye(engine_id="e", tp_rank=0))
    assert reason_of(codec, side, ab) == "bad_mac"


def test_without_a_secret_route_and_sequence_are_carried_but_not_checked():
    codec = Codec()
    frame = codec.encode(Goodbye(engine_id="e", tp_rank=0), Route("a", "b"), 7)
    assert codec.decode_seq(frame, Route("x", "y")) == (Goodbye(engine_id="e", tp_rank=0), 7)


@pytest.mark.parametrize("nonce", [b"", b"short", b"\x00" * 15, b"\x00" * 17], ids=len)
def test_challenge_nonce_must_have_16_bytes(nonce):
    assert reason_of(Codec(), Codec().encode(Challenge(nonce=nonce))) == "invalid"


def test_codec_repr_never_shows_the_key():
    assert SECRET.decode() not in repr(Codec(SECRET)) and "True" in repr(Codec(SECRET))


# -- compatibility hash and geometry digest --------------------------------------------------------


def test_compat_hash_shape_and_stability():
    h = M._compat_hash()
    assert re.fullmatch(r"[0-9a-f]{16}", h)
    assert h == M._compat_hash() == M.COMPAT_HASH


def test_compat_hash_changes_with_struct_fields_and_version(monkeypatch):
    base = M._compat_hash()

    class Heartbeat(msgspec.Struct, tag="hb", frozen=True, kw_only=True):  # noqa: F811
        engine_id: str
        tp_rank: int
        seq: int
        extra: int = 0

    args = tuple(Heartbeat if c is M.Heartbeat else c for c in MESSAGE_TYPES)
    monkeypatch.setattr(M, "Message", Union[args])  # type: ignore[valid-type]
    changed_field = M._compat_hash()
    assert changed_field != base

    class Heartbeat(msgspec.Struct, tag="hb", frozen=True, kw_only=True):  # noqa: F811
        engine_id: str
        tp_rank: int
        seq: str  # same name, other type

    args = tuple(Heartbeat if c is M.Heartbeat else c for c in MESSAGE_TYPES)
    monkeypatch.setattr(M, "Message", Union[args])  # type: ignore[valid-type]
    changed_type = M._compat_hash()
    assert changed_type not in (base, changed_field)

    class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True, kw_only=True):  # noqa: F811
        engine_id: str
        tp_rank: int
        seq: int

    args = tuple(Heartbeat if c is M.Heartbeat else c for c in MESSAGE_TYPES)
    monkeypatch.setattr(M, "Message", Union[args])  # type: ignore[valid-type]
    assert M._compat_hash() not in (base, changed_field, changed_type)

    monkeypatch.setattr(M, "Message", Union[MESSAGE_TYPES])  # type: ignore[valid-type]
    assert M._compat_hash() == base
    monkeypatch.setattr(M, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    assert M._compat_hash() != base


def test_compat_hash_same_in_another_process_and_under_another_import_path():
    """The hash names the wire format: it must not depend on the process or on the module path
    the package was imported under (an installed ``kv_push.common`` vs a source checkout's
    ``common``), or two identical installs refuse each other's handshake."""
    code = (  # the checkout first for ``common``, then off the path so ``kv_push`` is the install
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import common.messages as a; sys.path.pop(0);"
        "import kv_push.common.messages as b;"
        "print(a.COMPAT_HASH, b.COMPAT_HASH)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True, text=True,
                         check=True, cwd=str(REPO / "tests"),
                         env={**os.environ, "PYTHONHASHSEED": "123"}).stdout.split()
    assert out == [M.COMPAT_HASH, M.COMPAT_HASH]


def test_geometry_digest():
    d = geometry_digest(GEOM)
    assert re.fullmatch(r"[0-9a-f]{16}", d)
    assert d == geometry_digest(make_geometry())  # equal geometries, equal digests
    others = [
        make_geometry(tp_rank=0),
        make_geometry(num_blocks=33),
        make_geometry(token_order="HND"),
        make_geometry(k_bases=(GEOM.k_bases[0] + 1, GEOM.k_bases[1])),
        make_geometry(mem_type="VRAM"),
        make_geometry(dev_id=1),
        make_geometry(dtype="float16"),
    ]
    digests = {geometry_digest(g) for g in others}
    assert d not in digests
    assert len(digests) == len(others)


# -- rejections ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, -1, 2**63 - 1])
@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "hmac"])
def test_version_mismatch(version, secret):
    body = body_of(Heartbeat(engine_id="e", tp_rank=0, seq=1))
    assert reason_of(Codec(secret), envelope(version, body, mac_of(body))) == "version"
    assert reason_of(Codec(secret), envelope(version, body)) == "version"


def test_secret_configured_but_no_mac():
    codec = Codec(SECRET)
    for msg in sample_messages():
        assert reason_of(codec, Codec().encode(msg)) == "unauthenticated"
        assert reason_of(codec, envelope(PROTOCOL_VERSION, body_of(msg))) == "unauthenticated"


def test_wrong_mac_and_tampered_body():
    codec = Codec(SECRET)
    for msg in sample_messages():
        # signed with another key
        assert reason_of(codec, Codec(b"another key").encode(msg)) == "bad_mac"
        env = msgspec.msgpack.decode(codec.encode(msg), type=Envelope)
        # MAC truncated, flipped, or for a different body
        assert reason_of(codec, envelope(env.version, env.body, env.mac[:16])) == "bad_mac"
        flipped = bytes([env.mac[0] ^ 1]) + env.mac[1:]
        assert reason_of(codec, envelope(env.version, env.body, flipped)) == "bad_mac"
        # body tampered with, MAC kept: every single-byte change is caught
        for i in range(0, len(env.body), max(1, len(env.body) // 16)):
            body = bytearray(env.body)
            body[i] ^= 0x20
            assert reason_of(codec, envelope(env.version, bytes(body), env.mac)) == "bad_mac"
    # a forged Register with the right shape but without the key
    forged = body_of(Register(transfer_id="x", reg_id="x", prompt_digest="", attempt=9,
                              engine_id="evil", tp_rank=0, block_ids=(1,), first_token=0,
                              num_tokens=1, geometry_digest=""))
    assert reason_of(codec, envelope(PROTOCOL_VERSION, forged, mac_of(forged, b"guess"))) == "bad_mac"


def test_authentication_precedes_body_parsing():
    """With a secret, an unauthenticated frame is rejected as such even if its body is junk."""
    codec = Codec(SECRET)
    assert reason_of(codec, envelope(PROTOCOL_VERSION, b"\xc1junk")) == "unauthenticated"
    assert reason_of(codec, envelope(PROTOCOL_VERSION, b"\xc1junk", b"x" * 32)) == "bad_mac"
    junk = b"\xc1junk"
    assert reason_of(codec, envelope(PROTOCOL_VERSION, junk, mac_of(junk))) == "malformed"


def test_oversize():
    big = Hello(engine_id="d", agent_name="a", agent_metadata=b"m" * MAX_MESSAGE_BYTES,
                geometry=GEOM, compat_hash=M.COMPAT_HASH)
    for codec in (Codec(), Codec(SECRET)):
        frame = codec.encode(big)
        assert len(frame) > MAX_MESSAGE_BYTES
        assert reason_of(codec, frame) == "oversize"
        assert reason_of(codec, b"\x00" * (MAX_MESSAGE_BYTES + 1)) == "oversize"
    # just under the limit still decodes
    fits = Hello(engine_id="d", agent_name="a", agent_metadata=b"m" * (MAX_MESSAGE_BYTES - 2048),
                 geometry=GEOM, compat_hash=M.COMPAT_HASH)
    assert Codec().decode(Codec().encode(fits)) == fits


@pytest.mark.parametrize("data", [
    b"", b"\x00", b"\x93", b"\xc1", b"\x92\x01", b"\x91\x01",
    b"\x95" + bytes([PROTOCOL_VERSION]) + b"\xc4\x00\xc4\x00\x00\x00",
    b"\x80", b"\x93\x01\xa1x\xc4\x00", b"\x93\xa11\xc4\x00\xc4\x00", b"not msgpack at all",
    envelope(PROTOCOL_VERSION, b""), envelope(PROTOCOL_VERSION, b"\x80"),
    envelope(PROTOCOL_VERSION, msgspec.msgpack.encode({"type": "nope"})),
    envelope(PROTOCOL_VERSION, msgspec.msgpack.encode({"type": "hb", "engine_id": "e"})),
    envelope(PROTOCOL_VERSION, msgspec.msgpack.encode(
        {"type": "hb", "engine_id": "e", "tp_rank": "0", "seq": 1})),
    envelope(PROTOCOL_VERSION, body_of(Goodbye(engine_id="e", tp_rank=0)) + b"\x00"),
], ids=repr)
def test_malformed(data):
    assert reason_of(Codec(), data) == "malformed"


@pytest.mark.parametrize("data", ["a string", None, 42, ["list"]], ids=repr)
def test_not_bytes_is_malformed(data):
    assert reason_of(Codec(), data) == "malformed"


def test_every_proper_prefix_of_a_frame_is_malformed():
    for secret in (None, SECRET):
        codec = Codec(secret)
        for msg in sample_messages():
            frame = codec.encode(msg)
            for n in range(len(frame)):
                assert reason_of(codec, frame[:n]) == "malformed"


REG = Register(transfer_id="t", reg_id="r", prompt_digest="", attempt=0, engine_id="d",
               tp_rank=0, block_ids=(0, 1), first_token=0, num_tokens=20, geometry_digest=DIGEST)


@pytest.mark.parametrize("changes", [
    dict(block_ids=(0, -1)),
    dict(block_ids=(-(2**63),)),
    dict(first_token=21),
    dict(first_token=-1),
    dict(first_token=5, num_tokens=4),
    dict(num_tokens=-1, first_token=0),
    dict(attempt=-1),
    dict(transfer_id=""),
    dict(reg_id=""),
    dict(reg_id="r" * (M.MAX_ID_CHARS + 1)),
    dict(prompt_digest="d" * (M.MAX_ID_CHARS + 1)),
    dict(slot=M.Slot(offset=-1, length=4096, layers_per_chunk=1)),
    dict(slot=M.Slot(offset=0, length=0, layers_per_chunk=1)),
    dict(slot=M.Slot(offset=0, length=4096, layers_per_chunk=0)),
], ids=repr)
def test_invalid_register(changes):
    msg = msgspec.structs.replace(REG, **changes)
    for secret in (None, SECRET):
        assert reason_of(Codec(secret), Codec(secret).encode(msg)) == "invalid"


@pytest.mark.parametrize("msg", [
    CancelAck(transfer_id="t", reg_id="r", attempt=0, engine_id="p", tp_rank=0, chunks_done=-1),
    TransferFailed(transfer_id="t", reg_id="r", attempt=0, engine_id="p", tp_rank=0, reason="",
                   chunks_done=-1),
    WriteDone(transfer_id="t", reg_id="", attempt=0, engine_id="p", tp_rank=0, num_bytes=1),
    Cancel(transfer_id="t", reg_id="r", prompt_digest="", attempt=-1, engine_id="d", tp_rank=0,
           reason=""),
], ids=lambda m: type(m).__name__)
def test_invalid_answers(msg):
    assert reason_of(Codec(), Codec().encode(msg)) == "invalid"


def test_an_unknown_abandonment_reason_does_not_decode():
    """It becomes a metric label: only the known ones, whose literal type is in the hash."""
    msg = TransferFailed(transfer_id="t", reg_id="r", attempt=0, engine_id="p", tp_rank=0,
                         reason="", abandoned="client_bored")
    assert reason_of(Codec(), Codec().encode(msg)) == "malformed"
    for ok in ("", *M.ABANDONED):
        again = dict(msgspec.structs.asdict(msg), abandoned=ok)
        assert Codec().decode(Codec().encode(TransferFailed(**again))).abandoned == ok
    assert set(typing.get_args(M.Abandoned)) == {"", *M.ABANDONED}


@pytest.mark.parametrize("ids", [
    (), ("",), ("ok", ""), ("t" * (M.MAX_ID_CHARS + 1),),
    tuple(f"t{i}" for i in range(M.MAX_RELEASE_IDS + 1)),
], ids=lambda ids: f"{len(ids)} ids")
def test_invalid_release(ids):
    for secret in (None, SECRET):
        msg = Release(transfer_ids=ids, reply_to=b"n" * 16)
        assert reason_of(Codec(secret), Codec(secret).encode(msg)) == "invalid"


def test_unverified_challenge_reads_only_a_challenge():
    c = Challenge(nonce=b"n" * 16)
    assert M.unverified_challenge(Codec(b"key the router lacks").encode(c)) == c
    assert M.unverified_challenge(Codec().encode(c)) == c
    assert M.unverified_challenge(Codec().encode(Goodbye(engine_id="e", tp_rank=0))) is None
    bad = envelope(PROTOCOL_VERSION, body_of(Challenge(nonce=b"short")))
    assert M.unverified_challenge(bad) is None and M.unverified_challenge(b"\xc1") is None


def test_peek_kind_names_the_claimed_type_without_trusting_it():
    """For labelling a rejection only: the tag a frame claims, authenticated or not."""
    msg = Release(transfer_ids=("t",))
    assert M.peek_kind(Codec(b"another key").encode(msg)) == "release"
    assert M.peek_kind(Codec().encode(Goodbye(engine_id="e", tp_rank=0))) == "bye"
    for junk in (b"", b"\xc1", envelope(PROTOCOL_VERSION, b"\x93\x01\x02\x03"),
                 envelope(PROTOCOL_VERSION, msgspec.msgpack.encode({"type": 3}))):
        assert M.peek_kind(junk) == ""


@pytest.mark.parametrize("msg", [
    WriteDone(transfer_id="t", reg_id="r", attempt=0, engine_id="p", tp_rank=0, num_bytes=1,
              staged=True),
    WriteDone(transfer_id="t", reg_id="r", attempt=0, engine_id="p", tp_rank=0, num_bytes=1,
              staged=True, layer_lo=3, layer_hi=3),
    WriteDone(transfer_id="t", reg_id="r", attempt=0, engine_id="p", tp_rank=0, num_bytes=1,
              staged=True, layer_lo=-1, layer_hi=2),
    Hello(engine_id="d", agent_name="a", agent_metadata=b"", geometry=GEOM, compat_hash="h",
          staging=M.StagingRegion(base=0, length=4096)),
    Hello(engine_id="d", agent_name="a", agent_metadata=b"", geometry=GEOM, compat_hash="h",
          staging=M.StagingRegion(base=4096, length=0)),
], ids=repr)
def test_invalid_staged_fields(msg):
    assert reason_of(Codec(), Codec().encode(msg)) == "invalid"


def test_staged_fields_default_to_the_region_path():
    """A peer that does not stage leaves every staged field at its default."""
    assert Hello(engine_id="d", agent_name="a", agent_metadata=b"", geometry=GEOM,
                 compat_hash="h").staging is None
    assert REG.slot is None
    w = WriteDone(transfer_id="t", reg_id="r", attempt=0, engine_id="p", tp_rank=0, num_bytes=1)
    assert (w.staged, w.layer_lo, w.layer_hi) == (False, 0, 0)


def test_valid_register_edges():
    for changes in (dict(first_token=20), dict(block_ids=()), dict(attempt=2**63 - 1)):
        msg = msgspec.structs.replace(REG, **changes)
        assert Codec().decode(Codec().encode(msg)) == msg


BAD_GEOMETRIES = [
    dict(num_layers=0, k_bases=(), v_bases=()),
    dict(num_kv_heads=0),
    dict(head_size=-8),
    dict(dtype_bytes=0),
    dict(block_size=0),
    dict(tp_size=0),
    dict(tp_rank=2),
    dict(tp_rank=-1),
    dict(num_blocks=0),
    dict(num_kv_heads=3),  # 3 heads over TP 2
    dict(tp_size=3, tp_rank=0),  # 4 heads over TP 3
    dict(kv_parts=3),
    dict(kv_parts=1),  # with V bases still present
    dict(k_bases=(1,)),
    dict(v_bases=(1, 2, 3)),
    dict(block_stride=1),
    dict(mem_type="HBM"),
]


@pytest.mark.parametrize("changes", BAD_GEOMETRIES, ids=repr)
@pytest.mark.parametrize("kind", ["hello", "welcome"])
def test_bad_geometry_in_handshake_is_invalid(changes, kind):
    g = make_geometry(**changes)
    with pytest.raises(ValueError):
        g.validate()
    if kind == "hello":
        msg = Hello(engine_id="d", agent_name="a", agent_metadata=b"", geometry=g,
                    compat_hash=M.COMPAT_HASH)
    else:
        msg = Welcome(engine_id="p", agent_name="a", agent_metadata=b"", geometry=g,
                      compat_hash=M.COMPAT_HASH, side_channel_ports=(1,))
    assert reason_of(Codec(SECRET), Codec(SECRET).encode(msg)) == "invalid"


def test_bad_token_order_is_malformed():
    body = msgspec.msgpack.decode(body_of(next(m for m in sample_messages()
                                               if isinstance(m, Hello))))
    body["geometry"]["token_order"] = "XYZ"
    assert reason_of(Codec(), envelope(PROTOCOL_VERSION, msgspec.msgpack.encode(body))) == "malformed"


def test_rejection_carries_reason_and_detail():
    e = MessageRejected("bad_mac", "MAC does not match")
    assert isinstance(e, ValueError)
    assert (e.reason, e.detail, str(e)) == ("bad_mac", "MAC does not match",
                                            "bad_mac: MAC does not match")
    assert str(MessageRejected("invalid")) == "invalid"


# -- fuzzing -------------------------------------------------------------------------------------


def oracle_invalid(msg) -> bool:
    """The semantic rules, restated independently of ``messages._check_sane``."""
    per_registration = (Register, WriteDone, Cancel, CancelAck, TransferFailed)
    if isinstance(msg, per_registration) and (
            msg.transfer_id == "" or msg.reg_id == "" or msg.attempt < 0
            or len(msg.reg_id) > M.MAX_ID_CHARS):
        return True
    if isinstance(msg, (Register, Cancel)) and len(msg.prompt_digest) > M.MAX_ID_CHARS:
        return True
    if isinstance(msg, (CancelAck, TransferFailed)):
        return msg.chunks_done < 0
    if isinstance(msg, Register):
        s = msg.slot
        return (msg.first_token < 0 or msg.num_tokens < msg.first_token
                or any(b < 0 for b in msg.block_ids)
                or (s is not None and (s.offset < 0 or s.length < 1 or s.layers_per_chunk < 1)))
    if isinstance(msg, Challenge):
        return len(msg.nonce) != 16
    if isinstance(msg, Release):
        return (not 1 <= len(msg.transfer_ids) <= M.MAX_RELEASE_IDS
                or any(t == "" or len(t) > M.MAX_ID_CHARS for t in msg.transfer_ids))
    if isinstance(msg, WriteDone):
        return (msg.num_bytes < 0 or msg.chunks < 1 or msg.chunk < 0 or msg.chunk >= msg.chunks
                or (msg.staged and (msg.layer_lo < 0 or msg.layer_hi <= msg.layer_lo)))
    if isinstance(msg, (Hello, Welcome)):
        try:
            msg.geometry.validate()
        except ValueError:
            return True
        r = getattr(msg, "staging", None)
        if isinstance(msg, Hello) and r is not None and (r.base < 1 or r.length < 1):
            return True
    return False


def classify(codec: Codec, data) -> str:
    """Decode; return the message's type name or ``rejected:<reason>``. Anything else fails."""
    try:
        msg = codec.decode(data)
    except MessageRejected as e:
        assert e.reason in KNOWN_REASONS, (e.reason, bytes(data)[:64])
        return f"rejected:{e.reason}"
    assert type(msg) in MESSAGE_TYPES, type(msg)
    assert not oracle_invalid(msg), msg  # what decodes satisfies the semantic invariants
    assert codec.decode(codec.encode(msg)) == msg  # and re-encodes to itself
    return type(msg).__name__


i64 = st.integers(-(2**63), 2**63 - 1)
small = st.integers(-3, 70)
some_int = st.one_of(small, i64)
text = st.text(max_size=12)
ids = st.lists(some_int, max_size=6).map(tuple)

geometries = st.builds(
    KVGeometry,
    num_layers=st.integers(-1, 3), num_kv_heads=st.integers(-1, 9), head_size=small,
    dtype_bytes=st.integers(-1, 4), dtype=st.sampled_from(["bfloat16", "float16", ""]),
    block_size=small, token_order=st.sampled_from(["NHD", "HND"]), tp_size=st.integers(-1, 9),
    tp_rank=st.integers(-2, 9), num_blocks=small, block_stride=st.one_of(small, i64),
    k_bases=st.lists(i64, max_size=4).map(tuple), v_bases=st.lists(i64, max_size=4).map(tuple),
    mem_type=st.sampled_from(["DRAM", "VRAM", "HBM"]), dev_id=small, kv_parts=st.integers(0, 3),
) | st.just(GEOM) | st.just(make_geometry(tp_rank=0, token_order="HND"))

messages = st.one_of(
    st.builds(Challenge, nonce=st.binary(min_size=14, max_size=18)),
    st.builds(Hello, engine_id=text, agent_name=text, agent_metadata=st.binary(max_size=40),
              geometry=geometries, compat_hash=text, nonce=st.binary(max_size=20),
              reply_to=st.binary(max_size=20),
              staging=st.none() | st.builds(M.StagingRegion, base=some_int, length=some_int)),
    st.builds(Welcome, engine_id=text, agent_name=text, agent_metadata=st.binary(max_size=40),
              geometry=geometries, compat_hash=text,
              side_channel_ports=st.lists(some_int, max_size=4).map(tuple),
              reply_to=st.binary(max_size=20), staging=st.booleans()),
    st.builds(Refused, reason=text),
    st.builds(Register, transfer_id=text, attempt=some_int, engine_id=text, tp_rank=some_int,
              block_ids=ids, first_token=some_int, num_tokens=some_int, geometry_digest=text,
              slot=st.none() | st.builds(M.Slot, offset=some_int, length=some_int,
                                         layers_per_chunk=some_int)),
    st.builds(WriteDone, transfer_id=text, attempt=some_int, engine_id=text, tp_rank=some_int,
              num_bytes=some_int, chunk=small, chunks=small, staged=st.booleans(),
              layer_lo=small, layer_hi=small),
    st.builds(Cancel, transfer_id=text, attempt=some_int, engine_id=text, tp_rank=some_int,
              reason=text),
    st.builds(CancelAck, transfer_id=text, attempt=some_int, engine_id=text, tp_rank=some_int),
    st.builds(TransferFailed, transfer_id=text, attempt=some_int, engine_id=text,
              tp_rank=some_int, reason=text, abandoned=st.sampled_from(["", *M.ABANDONED])),
    st.builds(Heartbeat, engine_id=text, tp_rank=some_int, seq=some_int),
    st.builds(Goodbye, engine_id=text, tp_rank=some_int),
    st.builds(Release, transfer_ids=st.lists(text, max_size=4).map(tuple),
              reply_to=st.binary(max_size=20)),
    st.builds(ReleaseAck, accepted=some_int,
              side_channel_ports=st.lists(some_int, max_size=4).map(tuple)),
)

msgpack_values = st.recursive(
    st.none() | st.booleans() | i64 | st.floats(allow_nan=False) | text | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
TAGS = ["challenge", "hello", "welcome", "refused", "reg", "done", "cancel", "cancel_ack", "failed",
        "hb", "bye", "release", "release_ack"]


@settings(max_examples=700, deadline=None, suppress_health_check=list(HealthCheck))
@given(msg=messages, secret=st.sampled_from([None, SECRET]))
def test_fuzz_well_typed_messages(msg, secret):
    """Any well-typed message round-trips, unless it breaks a semantic rule: then "invalid"."""
    codec = Codec(secret)
    frame = codec.encode(msg)
    try:
        out = codec.decode(frame)
    except MessageRejected as e:
        assert e.reason == "invalid" and oracle_invalid(msg), (e, msg)
    else:
        assert out == msg and not oracle_invalid(msg)


@settings(max_examples=900, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    msg=st.sampled_from(sample_messages()),
    edits=st.lists(st.tuples(st.sampled_from(["drop", "set", "add", "tag", "geo"]), text,
                             msgpack_values), max_size=4),
    secret=st.sampled_from([None, SECRET]),
    version=st.sampled_from([PROTOCOL_VERSION] * 4 + [0, 2]),
)
def test_fuzz_structured_body_mutations(msg, edits, secret, version):
    """Bodies edited at the msgpack level, then correctly framed and signed: the body decoder and
    the semantic checks (not the MAC) are what must catch them."""
    body = msgspec.msgpack.decode(body_of(msg))
    keys = sorted(body)
    for op, name, value in edits:
        key = keys[zlib.crc32(name.encode()) % len(keys)]
        if op == "drop":
            body.pop(key, None)
        elif op == "set":
            body[key] = value
        elif op == "add":
            body[name] = value
        elif op == "tag":
            body["type"] = TAGS[len(name) % len(TAGS)] if len(name) % 3 else name
        elif op == "geo" and isinstance(body.get("geometry"), dict) and body["geometry"]:
            gkeys = sorted(body["geometry"])
            body["geometry"][gkeys[zlib.crc32(name.encode()) % len(gkeys)]] = value
    raw = msgspec.msgpack.encode(body)
    codec = Codec(secret)
    outcome = classify(codec, envelope(version, raw, mac_of(raw) if secret else b""))
    if version != PROTOCOL_VERSION:
        assert outcome == "rejected:version"
    else:
        assert outcome not in ("rejected:unauthenticated", "rejected:bad_mac", "rejected:version")


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(items=st.lists(msgpack_values, max_size=5), secret=st.sampled_from([None, SECRET]))
def test_fuzz_envelope_shapes(items, secret):
    classify(Codec(secret), msgspec.msgpack.encode(items))


def _mutate(rng: np.random.Generator, frame: bytes, pool: list[bytes]) -> bytes:
    data = bytearray(frame)
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(0, 8))
        n = len(data)
        if op == 0 and n:  # bit flip
            i = int(rng.integers(0, n))
            data[i] ^= 1 << int(rng.integers(0, 8))
        elif op == 1 and n:  # byte set to an interesting value
            data[int(rng.integers(0, n))] = int(rng.choice(
                [0x00, 0x01, 0x7F, 0x80, 0x90, 0x93, 0xC0, 0xC1, 0xC4, 0xCC, 0xCF, 0xD3, 0xDC,
                 0xDE, 0xFF]))
        elif op == 2:  # truncation
            del data[int(rng.integers(0, n + 1)):]
        elif op == 3:  # splice: my prefix, another frame's suffix
            other = pool[int(rng.integers(0, len(pool)))]
            data = data[: int(rng.integers(0, n + 1))] + other[int(rng.integers(0, len(other) + 1)):]
        elif op == 4 and n:  # delete a run
            i = int(rng.integers(0, n))
            del data[i: i + int(rng.integers(1, 9))]
        elif op == 5:  # insert random bytes
            i = int(rng.integers(0, n + 1))
            data[i:i] = rng.bytes(int(rng.integers(1, 9)))
        elif op == 6 and n:  # duplicate a run
            i = int(rng.integers(0, n))
            data[i:i] = data[i: i + int(rng.integers(1, 17))]
        elif op == 7 and n:  # random byte
            data[int(rng.integers(0, n))] = int(rng.integers(0, 256))
    return bytes(data)


def test_fuzz_random_bytes_and_frame_mutations():
    """100,000 random byte strings and 100,000 mutated valid frames, each through a plain and an
    authenticated codec: every outcome is a known message or a known rejection."""
    rng = np.random.default_rng(20240611)
    plain, authed = Codec(), Codec(SECRET)
    counts: dict[str, collections.Counter] = {}

    # 1. random byte strings, lengths 0..512, sliced out of one random buffer
    n_random = 100_000
    lengths = rng.integers(0, 513, size=n_random)
    # bias some toward msgpack-looking starts: a fixarray of 2-3 with version 1
    buf = rng.bytes(int(lengths.sum()))
    heads = [b"", b"\x92\x01", b"\x93\x01", b"\x93\x01\xc4", b"\x92\x01\xc4"]
    c = counts["random bytes"] = collections.Counter()
    off = 0
    for i, n in enumerate(lengths.tolist()):
        data = buf[off: off + n]
        off += n
        if i % 4 == 0:
            data = heads[i % len(heads)] + data
        c["plain " + classify(plain, data)] += 1
        c["hmac " + classify(authed, data)] += 1

    # 2. mutations of valid frames of every type, framed plain and with a MAC
    frames = [Codec(s).encode(m) for m in sample_messages() for s in (None, SECRET)]
    n_mut = 100_000
    c = counts["mutated frames"] = collections.Counter()
    for i in range(n_mut):
        data = _mutate(rng, frames[i % len(frames)], frames)
        c["plain " + classify(plain, data)] += 1
        c["hmac " + classify(authed, data)] += 1

    print()
    for name, counter in counts.items():
        print(f"fuzz {name}: {sum(counter.values()) // 2} inputs x 2 codecs")
        for outcome, k in sorted(counter.items(), key=lambda kv: -kv[1]):
            print(f"  {outcome:32s} {k:7d}")

    assert sum(counts["random bytes"].values()) == 2 * n_random
    assert sum(counts["mutated frames"].values()) == 2 * n_mut
    mut = counts["mutated frames"]
    # the mutator must actually reach every layer of the decoder, or it tests nothing
    for outcome in ("plain rejected:malformed", "hmac rejected:malformed",
                    "hmac rejected:bad_mac", "hmac rejected:unauthenticated",
                    "plain rejected:version", "plain rejected:secret_mismatch"):
        assert mut[outcome] > 0, outcome
    decoded_plain = sum(k for o, k in mut.items() if o.startswith("plain ") and ":" not in o)
    decoded_hmac = sum(k for o, k in mut.items() if o.startswith("hmac ") and ":" not in o)
    assert decoded_plain > decoded_hmac > 0
