"""Tests for kv_push.common.side_channel over real local sockets (no NIXL).

The two ends are tested against each other (``handshake`` against ``SideChannelServer``) and each
against a hand-driven socket, which can misbehave (say nothing, send junk, hang up) and can keep
or close the connection when the test says -- that is how the lifeline is exercised. A
hand-driven socket speaks the protocol as it is: the producer opens with ``Challenge``, the
decoder's Hello answers its nonce, the Welcome answers the Hello's (replayed nonces are tested in
tests/test_auth.py). Waits have a generous bound that is only reached when something is broken;
nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import errno
import os
import queue
import socket
import struct
import threading
import time

import pytest
from msgspec.structs import replace

from kv_push.common import geometry as G
from kv_push.common.decoder import Decoder, Outcome
from kv_push.common.messages import (
    COMPAT_HASH,
    MAX_MESSAGE_BYTES,
    NONCE_BYTES,
    Challenge,
    Codec,
    Hello,
    MessageRejected,
    Refused,
    Release,
    ReleaseAck,
    Welcome,
)
from kv_push.common.config import PushConfig
from kv_push.common.producer import Producer
from kv_push.common.side_channel import (
    HandshakeError,
    HandshakeRefused,
    ReleaseFailed,
    SideChannelServer,
    handshake,
    probe as probe_async,
    recv_frame,
    release,
    send_frame,
)
from kv_push.common.worker import PushWorker

from conftest import free_port
from fakes import FakeClock, FakeTransport, InlineExecutor, Node, Wire, role_config

WAIT = 10.0
GEOM = G.pooled(base=1 << 32, placement="kv_split", num_layers=2, num_kv_heads=2, head_size=8,
                dtype_bytes=2, dtype="bfloat16", block_size=4, num_blocks=8)
HELLO = Hello(engine_id="D", agent_name="D0", agent_metadata=b"meta:D0", geometry=GEOM,
              compat_hash=COMPAT_HASH)
WELCOME = Welcome(engine_id="P", agent_name="P0", agent_metadata=b"meta:P0", geometry=GEOM,
                  compat_hash=COMPAT_HASH, side_channel_ports=(5600,))


def bare(hello: Hello) -> Hello:
    """``hello`` without the handshake's nonces (which the side channel fills in)."""
    return replace(hello, nonce=b"", reply_to=b"")


def read_challenge(sock: socket.socket) -> Challenge:
    """Decoder side of a raw connection: the producer's opening frame."""
    msg = recv_frame(sock, Codec())
    assert isinstance(msg, Challenge) and len(msg.nonce) == NONCE_BYTES
    return msg


def challenge(conn: socket.socket) -> Hello:
    """Producer side of a raw connection: send a Challenge and read the Hello that answers it."""
    nonce = b"n" * NONCE_BYTES
    send_frame(conn, Codec(), Challenge(nonce=nonce))
    hello = recv_frame(conn, Codec())
    assert isinstance(hello, Hello) and hello.reply_to == nonce
    return hello


def welcome_for(hello: Hello) -> Welcome:
    return replace(WELCOME, reply_to=hello.nonce)


class Server:
    """A ``SideChannelServer`` on an ephemeral port that records what it was told."""

    def __init__(self, on_hello=None, *, secret: bytes | None = None, lifeline: bool = False,
                 timeout: float = WAIT, on_release=None, releases: bool = True):
        self.hellos: list[Hello] = []
        self.rejects: list[tuple[str, str]] = []
        self.releases: list[Release] = []
        self.release_rejects: list[tuple[str, str]] = []
        self.probes: list[str] = []
        self.closed: queue.SimpleQueue = queue.SimpleQueue()

        def answer(hello: Hello) -> Welcome:
            self.hellos.append(hello)
            return WELCOME

        def take(rel: Release) -> ReleaseAck:
            self.releases.append(rel)
            return ReleaseAck(accepted=len(rel.transfer_ids), side_channel_ports=(5600, 5601))

        self.srv = SideChannelServer(
            "127.0.0.1", 0, Codec(secret), on_hello or answer,
            on_reject=lambda reason, detail: self.rejects.append((reason, detail)),
            timeout=timeout, on_closed=self.closed.put if lifeline else None,
            on_release=(on_release or take) if releases else None,
            on_release_reject=lambda reason, detail: self.release_rejects.append((reason, detail)),
            on_probe=self.probes.append,
        ).start()
        self.port = self.srv.port

    def close(self) -> None:
        self.srv.close()


@pytest.fixture
def server():
    servers = []

    def make(*args, **kw) -> Server:
        s = Server(*args, **kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


class RawListener:
    """A listening socket the test drives by hand: ``accept()`` hands over each connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sock.settimeout(WAIT)

    def accept(self) -> socket.socket:
        conn, _ = self.sock.accept()
        conn.settimeout(WAIT)
        return conn

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listener():
    lst = RawListener()
    yield lst
    lst.close()


def wait_until(pred, step=lambda: None) -> bool:
    """Call ``step`` and test ``pred`` every 10 ms until it holds or ``WAIT`` passes."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        step()
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def in_thread(fn, *args, **kw) -> queue.SimpleQueue:
    """Run ``fn`` on a thread; the queue gets ("ok", result) or ("err", exception)."""
    out: queue.SimpleQueue = queue.SimpleQueue()

    def run() -> None:
        try:
            out.put(("ok", fn(*args, **kw)))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.put(("err", e))

    threading.Thread(target=run, daemon=True).start()
    return out


# -- frames --------------------------------------------------------------------------------------


def test_frames_round_trip_and_oversize_is_refused():
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, Codec(b"k"), HELLO)
        assert recv_frame(b, Codec(b"k")) == HELLO
        a.sendall(struct.pack("!I", MAX_MESSAGE_BYTES + 1))
        with pytest.raises(MessageRejected) as e:
            recv_frame(b, Codec())
        assert e.value.reason == "oversize"
        a.sendall(struct.pack("!I", 10) + b"abc")
        a.close()
        with pytest.raises(HandshakeError, match="mid-frame"):
            recv_frame(b, Codec())


# -- the handshake against the server ------------------------------------------------------------


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_handshake_is_welcomed(server, secret):
    s = server(secret=secret)
    welcome = handshake("127.0.0.1", s.port, HELLO, Codec(secret), WAIT)
    (hello,) = s.hellos
    assert bare(hello) == HELLO and len(hello.nonce) == NONCE_BYTES
    assert welcome == replace(WELCOME, reply_to=hello.nonce)
    assert s.rejects == []


def test_a_refusal_reaches_the_decoder_with_its_reason(server):
    def refuse(hello):
        raise MessageRejected("bad_layout", f"decoder {hello.engine_id}: head_size differs")

    s = server(refuse, lifeline=True)
    with pytest.raises(HandshakeError) as e:
        handshake("127.0.0.1", s.port, HELLO, Codec(), WAIT, on_closed=lambda w: None)
    assert "refused the handshake" in str(e.value) and "head_size differs" in str(e.value)
    assert [r for r, _ in s.rejects] == ["bad_layout"]
    assert "decoder D: head_size differs" in s.rejects[0][1]


def test_an_error_while_answering_is_a_refusal_not_a_hang(server):
    def broken(hello):
        raise KeyError("no such thing")

    s = server(broken)
    with pytest.raises(HandshakeError, match="refused the handshake: KeyError"):
        handshake("127.0.0.1", s.port, HELLO, Codec(), WAIT)


@pytest.mark.parametrize("server_secret,client_secret,reason,decoder_reason", [
    (b"right", b"wrong", "bad_mac", "bad_mac"),
    (b"right", None, "unauthenticated", "secret_mismatch"),
    (None, b"mine", "secret_mismatch", "unauthenticated"),
])
def test_a_handshake_with_the_wrong_secret_is_refused(server, server_secret, client_secret,
                                                      reason, decoder_reason):
    s = server(secret=server_secret)
    with pytest.raises(HandshakeRefused) as e:
        handshake("127.0.0.1", s.port, HELLO, Codec(client_secret), WAIT)
    # the decoder refuses the Challenge first: a refusal decided here, with its label and why
    assert e.value.rejected == decoder_reason
    assert e.value.reason.startswith(f"{decoder_reason}: the producer ")
    assert "refused here" in str(e.value) and f"127.0.0.1:{s.port}" in str(e.value)
    # the producer counts that Refused when it arrives
    assert wait_until(lambda: s.rejects)
    assert [r for r, _ in s.rejects] == [reason]
    assert s.hellos == []  # never reached the producer


def test_a_refusal_by_the_producer_is_not_marked_as_decided_here(server):
    def refuse(hello):
        raise MessageRejected("bad_layout", "head_size differs")

    s = server(refuse)
    with pytest.raises(HandshakeRefused) as e:
        handshake("127.0.0.1", s.port, HELLO, Codec(), WAIT)
    assert e.value.rejected is None and e.value.reason == "bad_layout: head_size differs"


def test_the_server_refuses_anything_but_hello(server):
    s = server()
    with socket.create_connection(("127.0.0.1", s.port), timeout=WAIT) as c:
        read_challenge(c)
        send_frame(c, Codec(), WELCOME)
        reply = recv_frame(c, Codec())
    assert isinstance(reply, Refused) and "Welcome on side channel" in reply.reason
    assert [r for r, _ in s.rejects] == ["unexpected"] and s.hellos == []


def test_the_server_refuses_an_oversize_frame(server):
    s = server()
    with socket.create_connection(("127.0.0.1", s.port), timeout=WAIT) as c:
        read_challenge(c)
        c.sendall(struct.pack("!I", MAX_MESSAGE_BYTES + 1))
        reply = recv_frame(c, Codec())
    assert isinstance(reply, Refused)
    assert [r for r, _ in s.rejects] == ["oversize"]


def test_a_client_that_hangs_up_mid_frame_is_counted(server):
    s = server()
    with socket.create_connection(("127.0.0.1", s.port), timeout=WAIT) as c:
        read_challenge(c)
        c.sendall(struct.pack("!I", 100) + b"partial")
    assert wait_until(lambda: s.rejects)
    assert [r for r, _ in s.rejects] == ["handshake_io"] and s.hellos == []


def test_a_port_in_use_is_a_clear_error(server):
    s = server()
    with pytest.raises(HandshakeError, match=f"cannot listen on 127.0.0.1:{s.port}"):
        SideChannelServer("127.0.0.1", s.port, Codec(), lambda h: WELCOME,
                          on_reject=lambda r, d: None, timeout=1.0)


# -- the handshake against a misbehaving producer ------------------------------------------------


def test_nobody_listening_is_a_handshake_error():
    port = free_port()
    with pytest.raises(HandshakeError, match=f"side channel 127.0.0.1:{port}"):
        handshake("127.0.0.1", port, HELLO, Codec(), WAIT)


def test_a_producer_that_never_answers_times_out(listener):
    result = in_thread(handshake, "127.0.0.1", listener.port, HELLO, Codec(), 0.2)
    conn = listener.accept()
    with conn:
        assert bare(challenge(conn)) == HELLO
        kind, value = result.get(timeout=WAIT)  # we never answer
    assert kind == "err" and isinstance(value, HandshakeError)


def test_a_producer_that_never_challenges_times_out(listener):
    result = in_thread(handshake, "127.0.0.1", listener.port, HELLO, Codec(), 0.2)
    with listener.accept():
        kind, value = result.get(timeout=WAIT)  # we never send the Challenge
    assert kind == "err" and isinstance(value, HandshakeError)
    assert "waiting for the producer's Challenge" in str(value)


@pytest.mark.parametrize("reply,match", [
    (lambda c: send_frame(c, Codec(), HELLO), "answered Hello, not Welcome"),
    (lambda c: send_frame(c, Codec(), WELCOME), "another handshake (replayed)"),
    (lambda c: c.sendall(struct.pack("!I", 4) + b"junk"), "bad reply"),
    (lambda c: c.sendall(struct.pack("!I", 40) + b"cut"), "mid-frame"),
])
def test_a_bad_answer_is_a_handshake_error(listener, reply, match):
    result = in_thread(handshake, "127.0.0.1", listener.port, HELLO, Codec(), WAIT)
    with listener.accept() as conn:
        challenge(conn)
        reply(conn)
    kind, value = result.get(timeout=WAIT)
    assert kind == "err" and isinstance(value, HandshakeError)
    assert match in str(value)


# -- the lifeline --------------------------------------------------------------------------------


def test_the_decoder_hears_when_the_producer_closes_its_side_channel(listener):
    closed: queue.SimpleQueue = queue.SimpleQueue()
    result = in_thread(handshake, "127.0.0.1", listener.port, HELLO, Codec(), WAIT,
                       on_closed=closed.put)
    conn = listener.accept()
    welcome = welcome_for(challenge(conn))
    send_frame(conn, Codec(), welcome)
    assert result.get(timeout=WAIT) == ("ok", welcome)
    with pytest.raises(queue.Empty):
        closed.get(timeout=0.2)  # the connection stays open: the producer is alive
    conn.close()  # what the kernel does when the producer process dies
    assert closed.get(timeout=WAIT) == welcome


def test_the_producer_hears_when_the_decoder_closes_its_side_channel(server):
    s = server(lifeline=True)
    hello = replace(HELLO, nonce=b"d" * NONCE_BYTES)
    with socket.create_connection(("127.0.0.1", s.port), timeout=WAIT) as c:
        hello = replace(hello, reply_to=read_challenge(c).nonce)
        send_frame(c, Codec(), hello)
        assert recv_frame(c, Codec()) == welcome_for(hello)
        with pytest.raises(queue.Empty):
            s.closed.get(timeout=0.2)  # still connected
    assert s.closed.get(timeout=WAIT) == hello


def test_the_decoder_can_sever_its_lifeline_and_the_producer_hears_it(server):
    # what a decoder does when a producer outlives the fence bound (issue 9 item 4)
    s = server(lifeline=True)
    closed: queue.SimpleQueue = queue.SimpleQueue()
    severs: list = []
    welcome = handshake("127.0.0.1", s.port, HELLO, Codec(), WAIT, on_closed=closed.put,
                        on_open=severs.append)
    (hello,) = s.hellos
    assert welcome == welcome_for(hello)
    with pytest.raises(queue.Empty):
        s.closed.get(timeout=0.2)
    (sever,) = severs
    sever()
    assert s.closed.get(timeout=WAIT) == hello  # the producer drops the decoder
    assert closed.get(timeout=WAIT) == welcome  # and our own watcher sees it closed
    sever()  # twice: harmless


def test_a_producer_closing_its_side_channel_ends_its_lifelines(server):
    """A producer worker closed while its process lives on (server_watch) kept every
    decoder's lifeline open -- and their handler threads and connection slots -- until the
    decoders died: they never learnt it was gone."""
    s = server(lifeline=True)
    closed: queue.SimpleQueue = queue.SimpleQueue()
    welcome = handshake("127.0.0.1", s.port, HELLO, Codec(), WAIT, on_closed=closed.put)
    with pytest.raises(queue.Empty):
        closed.get(timeout=0.2)
    s.close()
    assert closed.get(timeout=WAIT) == welcome  # the decoder hears it
    assert s.closed.get(timeout=WAIT) == s.hellos[0]  # and the handler thread is done


def test_lifelines_of_decoders_still_being_written_stay_open_at_close(server):
    """A producer closing with a WRITE to a decoder still in flight (its transfer thread's drain
    ran out) must leave that decoder's lifeline open -- its closing would let the decoder free
    the blocks the WRITE lands in -- and close the others."""
    s = server(lifeline=True)
    closed = {name: queue.SimpleQueue() for name in ("D0", "D1")}
    for name in closed:
        handshake("127.0.0.1", s.port, replace(HELLO, agent_name=name), Codec(), WAIT,
                  on_closed=closed[name].put)
    s.srv.stop_listening()
    s.srv.close_lifelines(keep={"D0"})
    assert closed["D1"].get(timeout=WAIT).agent_name == "P0"
    with pytest.raises(queue.Empty):
        closed["D0"].get(timeout=0.3)


def test_a_peer_that_drips_its_frame_is_cut_off_at_the_time_out(server):
    """The time-out bounded each recv, not the frame: a peer sending a byte every 0.3 s held a
    handler thread and a connection slot for as long as it liked (1,024 such filled the side
    channel). Now the whole frame must come within the time-out."""
    s = server(timeout=1.0)
    with socket.create_connection(("127.0.0.1", s.port), timeout=WAIT) as c:
        read_challenge(c)
        t0 = time.monotonic()
        frame = struct.pack("!I", 64) + b"x" * 64
        cut = None
        for byte in frame:
            try:
                c.sendall(bytes([byte]))
                time.sleep(0.3)
            except OSError:
                cut = time.monotonic() - t0
                break
        if cut is None:  # every byte went out (the kernel buffers them): the end is read
            c.settimeout(WAIT)
            assert c.recv(64) == b""
            cut = time.monotonic() - t0
    assert cut < 4, cut  # not 64 x 0.3 s
    assert [r for r, _ in s.rejects] == ["handshake_io"], s.rejects


def test_without_a_lifeline_the_handshake_closes_the_connection(server):
    s = server(lifeline=True)
    handshake("127.0.0.1", s.port, HELLO, Codec(), WAIT)  # no on_closed: closes at once
    assert s.closed.get(timeout=WAIT) == s.hellos[0]


def test_a_refused_handshake_holds_no_lifeline(server):
    def refuse(hello):
        raise MessageRejected("incompatible", "old version")

    s = server(refuse, lifeline=True)
    closed: queue.SimpleQueue = queue.SimpleQueue()
    with pytest.raises(HandshakeError):
        handshake("127.0.0.1", s.port, HELLO, Codec(), WAIT, on_closed=closed.put)
    with pytest.raises(queue.Empty):
        s.closed.get(timeout=0.2)
    assert closed.empty()


# -- the roles over a real side channel ----------------------------------------------------------


def test_roles_handshake_over_the_side_channel_and_the_lifeline_reaches_the_decoder(listener):
    """A real decoder dials a hand-held socket answered by a real producer's ``accept_hello``;
    closing that socket (the producer "dies") fails the decoder's request."""
    wire, clock = Wire(), FakeClock()
    p = Node(wire, clock, "P", GEOM, role_config())
    d = Node(wire, clock, "D", GEOM, role_config())
    producer = Producer(p.thread, on_released=lambda key: None, side_channel_ports=(listener.port,))
    p.thread.add_role(producer)
    decoder = Decoder(d.thread, executor=InlineExecutor())  # the real side_channel.handshake
    d.thread.add_role(decoder)

    def serve() -> socket.socket:
        conn = listener.accept()
        hello = challenge(conn)
        send_frame(conn, Codec(), replace(producer.accept_hello(hello), reply_to=hello.nonce))
        return conn

    held = in_thread(serve)
    d.thread.submit(lambda: decoder.expect("req-1", "t1", 0, ("127.0.0.1", listener.port),
                                           (2, 3), 0, 8))
    d.step()  # dials, is welcomed, registers
    kind, conn = held.get(timeout=WAIT)
    assert kind == "ok"
    assert p.thread.peer("D") is not None and d.thread.peer("P") is not None
    assert d.count("registrations_sent") == 1 and p.count("handshakes") == 1
    assert decoder.outcomes.empty()
    conn.close()
    assert wait_until(lambda: not decoder.outcomes.empty(), step=d.step)
    assert decoder.outcomes.get_nowait() == Outcome("req-1", "failed",
                                                    "producer P rank 0 is dead")
    assert d.thread.peer("P") is None and d.count("peers_dead") == 1
    decoder.close()


@pytest.mark.parametrize("producer_secret,decoder_secret,decided", [
    (b"s3cret", None, "secret_mismatch"),  # the new-user case: KV_PUSH_SECRET on P only
    (None, b"s3cret", "unauthenticated"),
    (b"s3cret", b"other", "bad_mac"),
])
def test_a_refusal_decided_by_the_decoder_is_counted_like_one_by_the_producer(
        server, producer_secret, decoder_secret, decided):
    """A secret on one side only: the decoder rejects the producer's Challenge. It counts that in
    ``rejected{reason}`` and in ``handshake_refusals{P_HOST:P_PORT reason}`` (what the router
    reads), as it counts a producer's ``Refused``, and the request fails with the reason."""
    s = server(secret=producer_secret)
    wire, clock = Wire(), FakeClock()
    d = Node(wire, clock, "D", GEOM, role_config(secret=decoder_secret or b""))
    decoder = Decoder(d.thread, executor=InlineExecutor())  # the real side_channel.handshake
    d.thread.add_role(decoder)
    d.thread.submit(lambda: decoder.expect("req-1", "t1", 0, ("127.0.0.1", s.port),
                                           (2, 3), 0, 8))
    d.step()  # dials and is refused (by itself)
    assert wait_until(lambda: not decoder.outcomes.empty(), step=d.step)
    outcome = decoder.outcomes.get_nowait()
    assert outcome.kind == "failed" and f"{decided}: the producer " in outcome.reason
    assert d.count("rejected", label=decided) == 1
    refusals = {k: v for k, v in d.counters.snapshot().items()
                if k.startswith("handshake_refusals{")}
    ((label, count),) = refusals.items()
    assert count == 1 and label.startswith(f"handshake_refusals{{127.0.0.1:{s.port} {decided}: ")
    assert d.count("handshake_failures") == 1
    assert wait_until(lambda: s.rejects) and s.hellos == []  # and P heard why
    decoder.close()


# -- the router's release ------------------------------------------------------------------------


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_a_release_is_answered_with_every_ranks_port(server, secret):
    s = server(secret=secret)
    ack = release("127.0.0.1", s.port, ("t1", "t2"), Codec(secret), WAIT)
    assert ack == ReleaseAck(accepted=2, side_channel_ports=(5600, 5601))
    (rel,) = s.releases
    assert rel.transfer_ids == ("t1", "t2") and len(rel.reply_to) == NONCE_BYTES
    assert s.rejects == s.release_rejects == [] and s.hellos == []


@pytest.mark.parametrize("p_secret,r_secret,reason", [
    (b"s3cret", None, "unauthenticated"),
    (None, b"s3cret", "secret_mismatch"),
    (b"s3cret", b"another", "bad_mac"),
])
def test_a_release_under_another_secret_is_refused_and_counted_as_a_release(
        server, p_secret, r_secret, reason):
    s = server(secret=p_secret)
    with pytest.raises(ReleaseFailed) as e:
        release("127.0.0.1", s.port, ("t1",), Codec(r_secret), WAIT)
    assert e.value.kind == "refused"
    # the router cannot authenticate P's challenge either, but answers it all the same: P
    # judges the Release, counts it as a release, and the router says why from its side
    assert [r for r, _ in s.release_rejects] == [reason]
    assert s.rejects == [] and s.releases == []
    assert "secret" in str(e.value) and e.value.reason in (
        "unauthenticated", "secret_mismatch", "bad_mac")


def _recorded_release(port: int, codec: Codec) -> tuple[bytes, object]:
    """A Release sent on a raw connection that answers its challenge: (its frame, the reply)."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.settimeout(WAIT)
        challenge_ = recv_frame(sock, codec)
        frame = codec.encode(Release(transfer_ids=("t1",), reply_to=challenge_.nonce))
        sock.sendall(struct.pack("!I", len(frame)) + frame)
        return frame, recv_frame(sock, codec)


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_a_recorded_release_never_works_again(server, secret):
    """The Release answers one connection's challenge; with a secret the MAC binds that nonce,
    so a recorded frame (or one edited to answer a new challenge) is refused."""
    s = server(secret=secret)
    codec = Codec(secret)
    frame, reply = _recorded_release(s.port, codec)
    assert isinstance(reply, ReleaseAck) and len(s.releases) == 1
    with socket.create_connection(("127.0.0.1", s.port), timeout=WAIT) as sock:
        sock.settimeout(WAIT)
        recv_frame(sock, codec)  # a new challenge, unanswered: replay the recorded frame
        sock.sendall(struct.pack("!I", len(frame)) + frame)
        reply = recv_frame(sock, codec)
    assert isinstance(reply, Refused) and reply.reason.startswith("replayed")
    assert len(s.releases) == 1 and [r for r, _ in s.release_rejects] == ["replayed"]
    if secret:  # nor can the recorded body be re-pointed at a new nonce without the key
        from kv_push.common.messages import Envelope, _body_encoder
        import msgspec
        env = msgspec.msgpack.decode(frame, type=Envelope)
        with socket.create_connection(("127.0.0.1", s.port), timeout=WAIT) as sock:
            sock.settimeout(WAIT)
            fresh = recv_frame(sock, codec).nonce
            body = _body_encoder.encode(Release(transfer_ids=("t1",), reply_to=fresh))
            forged = _body_encoder.encode(Envelope(env.version, body, env.mac, env.seq))
            sock.sendall(struct.pack("!I", len(forged)) + forged)
            reply = recv_frame(sock, codec)
        assert isinstance(reply, Refused) and "bad_mac" in reply.reason
        assert len(s.releases) == 1
        assert [r for r, _ in s.release_rejects] == ["replayed", "bad_mac"]


def test_a_side_channel_without_a_release_handler_refuses_one(server):
    s = server(releases=False)
    with pytest.raises(ReleaseFailed) as e:
        release("127.0.0.1", s.port, ("t1",), Codec(), WAIT)
    assert e.value.kind == "refused" and "unexpected" in str(e.value)


def test_a_release_handler_that_raises_is_a_refusal_not_a_hang(server):
    def broken(rel):
        raise RuntimeError("transfer thread closed")

    s = server(on_release=broken)
    with pytest.raises(ReleaseFailed, match="transfer thread closed") as e:
        release("127.0.0.1", s.port, ("t1",), Codec(), WAIT)
    assert e.value.kind == "refused"
    assert [r for r, _ in s.release_rejects] == ["internal_error"]


def test_a_release_to_nobody_or_to_a_silent_listener_fails_within_its_bound(listener):
    with pytest.raises(ReleaseFailed) as e:
        release("127.0.0.1", free_port(), ("t1",), Codec(), WAIT)
    assert e.value.kind == "connect"
    held = in_thread(release, "127.0.0.1", listener.port, ("t1",), Codec(), 0.2)
    conn = listener.accept()  # accepted, never challenged
    kind, err = held.get(timeout=WAIT)
    conn.close()
    assert kind == "err" and isinstance(err, ReleaseFailed) and err.kind == "timeout"


def test_a_release_answered_with_something_else_is_a_bad_reply(listener):
    def serve() -> None:
        conn = listener.accept()
        with conn:
            send_frame(conn, Codec(), Challenge(nonce=b"n" * NONCE_BYTES))
            recv_frame(conn, Codec())
            send_frame(conn, Codec(), WELCOME)

    done_ = in_thread(serve)
    with pytest.raises(ReleaseFailed) as e:
        release("127.0.0.1", listener.port, ("t1",), Codec(), WAIT)
    assert e.value.kind == "bad_reply"
    assert done_.get(timeout=WAIT)[0] == "ok"


# -- the router's /health?probe: is a producer's side channel there, under our secret? --------


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_a_probe_reads_the_challenge_and_is_counted_as_a_probe_not_a_failure(server, secret):
    s = server(secret=secret)
    assert probe("127.0.0.1", s.port, Codec(secret), WAIT) is None
    assert wait_until(lambda: len(s.probes) == 1)
    assert s.rejects == [] and s.release_rejects == [] and s.hellos == []


def probe(*args):
    return asyncio.run(probe_async(*args))


def test_a_probe_says_what_is_wrong(server, listener):
    # nobody listening (a wrong kv= port)
    port = free_port()
    problem = probe("127.0.0.1", port, Codec(), WAIT)
    assert problem is not None and f"KV side channel 127.0.0.1:{port}" in problem
    assert "refused" in problem.lower()
    # another secret
    s = server(secret=b"theirs")
    problem = probe("127.0.0.1", s.port, Codec(b"ours"), WAIT)
    assert problem is not None and "secret" in problem, problem
    # a listener that never speaks (another service on that port)
    held = in_thread(probe, "127.0.0.1", listener.port, Codec(), 0.2)
    conn = listener.accept()
    kind, problem = held.get(timeout=WAIT)
    conn.close()
    assert kind == "ok" and "connected, but no challenge within 0.2s" in problem, problem
    # a side channel at its connection cap answers Refused: its reason is shown
    full = server()
    full.srv._server.active = 10**6
    problem = probe("127.0.0.1", full.port, Codec(), WAIT)
    assert problem is not None and "refused the connection: side_channel_full" in problem


def test_a_peer_closing_mid_frame_is_still_a_failed_handshake(server):
    """Only a connection closed before any byte of its frame is a probe."""
    s = server()
    with socket.create_connection(("127.0.0.1", s.port), timeout=WAIT) as sock:
        read_challenge(sock)
        sock.sendall(struct.pack("!I", 100) + b"xy")
    assert wait_until(lambda: [r for r, _ in s.rejects] == ["handshake_io"])
    assert s.probes == []


# -- a producer worker's side channel hands the release to its transfer thread -------------------


def _worker(wire: Wire, name: str, port: int, tp: int = 1, rank: int = 0,
            secret: bytes = b"") -> PushWorker:
    geometry = G.pooled(base=1 << 32, placement="kv_split", num_layers=2, num_kv_heads=2,
                        head_size=8, dtype_bytes=2, dtype="bfloat16", block_size=4,
                        num_blocks=8, tp_size=tp, tp_rank=rank)
    return PushWorker(geometry=geometry, role="producer",
                      config=PushConfig(side_channel_port=port, secret=secret),
                      transport_factory=lambda: FakeTransport(wire, name)).start()


def test_a_release_reaches_the_producer_worker_and_its_blocks_are_freed():
    wire = Wire()
    w = _worker(wire, "P", 0, secret=b"k")
    try:
        w.prefill_done("req-1", "t1", (0, 1), 8)
        w.prefill_done("req-2", "t2", (2, 3), 8)
        assert wait_until(lambda: w.live()["sources"] == 2)
        host, port = w.side_channel_address
        ack = release(host, port, ("t1",), Codec(b"k"), WAIT)
        assert ack.accepted == 1 and ack.side_channel_ports == (port,)
        freed: list[str] = []
        assert wait_until(lambda: freed.extend(w.drain_released()) or freed == ["req-1"])
        assert w.counters.get("released") == 1 and w.live()["sources"] == 1
        with pytest.raises(ReleaseFailed):  # another key: refused, counted as a release
            release(host, port, ("t2",), Codec(b"wrong"), WAIT)
        assert w.counters.get("release_rejected", label="bad_mac") == 1
        assert w.counters.get("rejected", label="bad_mac") == 0
        assert w.live()["sources"] == 1 and w.drain_released() == []
        # the router's health probe: counted as such, not as a failed handshake
        assert probe(host, port, Codec(b"k"), WAIT) is None
        assert wait_until(lambda: w.counters.get("side_channel_probes") == 1)
        assert w.counters.get("rejected", label="handshake_io") == 0
    finally:
        w.close()


class _BreakingSocket:
    """A lifeline socket whose ``recv`` ends as given: b"" (the peer closed it) or an error."""

    def __init__(self, end):
        self.end, self.closed = end, False

    def settimeout(self, _):
        pass

    def setsockopt(self, *_):
        pass

    def recv(self, _):
        if isinstance(self.end, OSError):
            raise self.end
        return self.end

    def close(self):
        self.closed = True


@pytest.mark.parametrize("end, proven", [
    (b"", True),  # end of stream: the peer's kernel closed it
    (ConnectionResetError(errno.ECONNRESET, "reset"), True),
    (TimeoutError(errno.ETIMEDOUT, "Connection timed out"), False),  # keepalive gave up
    (OSError(errno.EHOSTUNREACH, "No route to host"), False),
])
def test_a_lifeline_tells_a_proven_end_from_a_broken_path(end, proven):
    from kv_push.common.side_channel import hold_lifeline

    calls = []
    sock = _BreakingSocket(end)
    hold_lifeline(sock, lambda: calls.append("closed"), lambda why: calls.append(("broken", why)))
    assert sock.closed
    if proven:
        assert calls == ["closed"]
    else:
        assert calls == [("broken", os.strerror(end.errno))]
    # without an on_unproven, every end is reported as closed (the producer's side: it stops
    # writing to a decoder it cannot reach, the safe direction)
    calls.clear()
    hold_lifeline(_BreakingSocket(end), lambda: calls.append("closed"))
    assert calls == ["closed"]
