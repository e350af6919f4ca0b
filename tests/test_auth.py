"""The authenticated control plane (common/auth.py and the code it guards): replay protection of
notifications, the nonce-bound side-channel handshake, the lifeline bound to the agent name in the
NIXL metadata, the side-channel connection cap, a secret on one side only, and the secret kept out
of every repr and log line. Router-signed transfer parameters are tested with the connector
(tests/test_connector.py) and the router (tests/test_router.py).

Everything runs over the in-memory fake transport of test_transfer_thread and real sockets on
loopback; no NIXL.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
from msgspec.structs import replace

from kv_push.common import geometry as G
from kv_push.common.auth import (
    REPLAY_WINDOW,
    NotificationChannel,
    ReplayWindow,
    TransferParamsSigner,
    load_secret,
)
from kv_push.common.config import PushConfig
from kv_push.common.messages import (
    COMPAT_HASH,
    Cancel,
    Challenge,
    Codec,
    Goodbye,
    Hello,
    MessageRejected,
    Refused,
    Welcome,
    geometry_digest,
)
from kv_push.common.side_channel import (
    HandshakeError,
    SideChannelServer,
    handshake,
    recv_frame,
)
from kv_push.common.worker import PushWorker

try:
    from test_transfer_thread import FakeTransport, Harness, Wire, reg_msg, sync
except ModuleNotFoundError:  # imported as a package module
    from tests.test_transfer_thread import FakeTransport, Harness, Wire, reg_msg, sync

SECRET = b"auth-test-secret-7f3a"
TIMEOUT = 5.0
GEOM = G.pooled(base=1 << 32, placement="kv_split", num_layers=2, num_kv_heads=2, head_size=8,
                dtype_bytes=2, dtype="bfloat16", block_size=4, num_blocks=8)


# -- replay window ---------------------------------------------------------------------------------


def test_replay_window_accepts_each_number_once_in_any_order_within_the_window():
    w = ReplayWindow(8)
    for seq in (5, 3, 4, 1, 9, 6, 2):  # reordered, with gaps
        w.mark(seq)
    for seq in (5, 3, 9, 2):
        with pytest.raises(MessageRejected, match="already received") as e:
            w.mark(seq)
        assert e.value.reason == "replay"
    w.mark(7)  # never seen, still inside the window below 9
    w.mark(20)  # a jump: everything more than 8 below 20 is now too old
    for seq in (12, 9, 1):
        with pytest.raises(MessageRejected, match="behind the newest"):
            w.mark(seq)
    w.mark(13)
    for seq in (0, -1):  # an unsequenced frame (seq 0: a side-channel frame) is never accepted
        with pytest.raises(MessageRejected, match="unsequenced"):
            w.mark(seq)


def test_channel_numbers_per_receiver_and_starts_above_an_earlier_incarnation():
    now = [100.0]
    codec = Codec(SECRET)
    a = NotificationChannel(codec, "A", clock=lambda: now[0])
    b = NotificationChannel(codec, "B")
    c = NotificationChannel(codec, "C")
    frames_b = [a.seal("B", Goodbye(engine_id="a", tp_rank=0)) for _ in range(3)]
    frames_c = [a.seal("C", Goodbye(engine_id="a", tp_rank=0)) for _ in range(2)]
    for f in frames_b:
        b.open("A", f)
    for f in frames_c:
        c.open("A", f)
    # a frame for B does not open at C, nor as if it came from someone else
    with pytest.raises(MessageRejected) as e:
        c.open("A", frames_b[0])
    assert e.value.reason == "bad_mac"
    with pytest.raises(MessageRejected) as e:
        b.open("C", frames_b[0])
    assert e.value.reason == "bad_mac"
    # A restarts under the same name (a reused agent name): its new numbers start above the old
    a2 = NotificationChannel(codec, "A", clock=lambda: now[0] + 1)
    b.open("A", a2.seal("B", Goodbye(engine_id="a", tp_rank=0)))
    # a bounded book: the least recently used counters go, and come back above the old numbers
    small = NotificationChannel(codec, "S", max_pairs=2, clock=lambda: now[0])
    x = NotificationChannel(codec, "X")
    x.open("S", small.seal("X", Goodbye(engine_id="s", tp_rank=0)))
    small.seal("Y", Goodbye(engine_id="s", tp_rank=0))
    small.seal("Z", Goodbye(engine_id="s", tp_rank=0))  # X's counter is forgotten here
    now[0] += 1
    x.open("S", small.seal("X", Goodbye(engine_id="s", tp_rank=0)))


@pytest.fixture
def authed():
    h = Harness(secret=SECRET)
    yield h
    h.close()


def test_recorded_register_cancel_and_goodbye_are_rejected_when_replayed(authed):
    """Today's bug: a recorded Goodbye replays (and drops the peer). Each replay is rejected and
    counted; the original was handled exactly once."""
    h = authed
    h.connect_b()
    reg = h.b_send(reg_msg("t1"))
    cancel = h.b_send(Cancel(transfer_id="t1", reg_id="t1", prompt_digest="", attempt=0,
                                  engine_id="B", tp_rank=0, reason="x"))
    sync(h.t)
    assert [type(m).__name__ for _, m in h.role.messages] == ["Register", "Cancel"]
    for frame in (reg, cancel, reg):
        assert h.b.send_notif("A", frame)
    sync(h.t)
    assert h.rejected("replay") == 3
    assert len(h.role.messages) == 2
    bye = h.b_send(Goodbye(engine_id="B", tp_rank=0))
    sync(h.t)
    assert [p.agent_name for p in h.role.dead] == ["B"]
    h.connect_b()  # B comes back (a new handshake)
    assert h.b.send_notif("A", bye)  # someone replays B's old Goodbye
    sync(h.t)
    assert h.rejected("replay") == 4
    assert h.t.call(lambda: set(h.t.peers), TIMEOUT) == {"B"}  # not dropped
    assert len(h.role.dead) == 1
    h.b_send(reg_msg("t2"))  # and B's new messages still land
    sync(h.t)
    assert [m.transfer_id for _, m in h.role.messages if hasattr(m, "transfer_id")][-1] == "t2"


def test_reordered_notifications_are_accepted_within_the_window(authed):
    h = authed
    h.connect_b()
    frames = [h.chan_b.seal("A", reg_msg(f"t{i}")) for i in range(5)]
    for i in (4, 0, 2, 1, 3):
        assert h.b.send_notif("A", frames[i])
    sync(h.t)
    assert [m.transfer_id for _, m in h.role.messages] == ["t4", "t0", "t2", "t1", "t3"]
    assert h.rejected("replay") == 0
    # far behind: more than REPLAY_WINDOW numbers were used since
    old = h.chan_b.seal("A", reg_msg("old"))
    for _ in range(REPLAY_WINDOW):
        h.chan_b.seal("A", reg_msg("skipped"))
    h.b_send(reg_msg("new"))
    assert h.b.send_notif("A", old)
    sync(h.t)
    assert [m.transfer_id for _, m in h.role.messages][-1] == "new"
    assert h.rejected("replay") == 1


def test_a_frame_for_one_peer_is_rejected_from_another(authed):
    h = authed
    h.connect_b()
    c = FakeTransport(h.wire, "C")
    c.add_peer(h.meta_a)
    meta_c = c.metadata()
    h.t.call(lambda: h.t.add_peer(meta_c, engine_id="C", tp_rank=0, geometry=GEOM,
                                  digest=geometry_digest(GEOM)), TIMEOUT)
    frame = h.chan_b.seal("A", Goodbye(engine_id="B", tp_rank=0))
    assert c.send_notif("A", frame)  # C forwards B's Goodbye as its own
    sync(h.t)
    assert h.rejected("bad_mac") == 1
    assert h.t.call(lambda: set(h.t.peers), TIMEOUT) == {"B", "C"}


def test_add_peer_refuses_metadata_of_another_agent_than_named():
    h = Harness()
    try:
        meta_b = h.b.metadata()
        with pytest.raises(MessageRejected) as e:
            h.t.call(lambda: h.t.add_peer(meta_b, engine_id="B", tp_rank=0, geometry=GEOM,
                                          digest=geometry_digest(GEOM), agent_name="victim"),
                     TIMEOUT)
        assert e.value.reason == "name_mismatch"
        assert "B" not in h.ta.peers  # nothing left loaded
        # a known peer named wrongly by someone else's handshake stays loaded
        h.connect_b()
        with pytest.raises(MessageRejected):
            h.t.call(lambda: h.t.add_peer(meta_b, engine_id="B", tp_rank=0, geometry=GEOM,
                                          digest=geometry_digest(GEOM), agent_name="X"), TIMEOUT)
        assert "B" in h.ta.peers and h.t.call(lambda: set(h.t.peers), TIMEOUT) == {"B"}
        peer = h.t.call(lambda: h.t.add_peer(meta_b, engine_id="B", tp_rank=0, geometry=GEOM,
                                             digest=geometry_digest(GEOM), agent_name="B"),
                        TIMEOUT)
        assert peer.agent_name == "B"
    finally:
        h.close()


# -- the side channel ------------------------------------------------------------------------------


def hello(name: str = "dec", metadata: bytes | None = None) -> Hello:
    return Hello(engine_id=f"engine-{name}", agent_name=name,
                 agent_metadata=b"meta:" + name.encode() if metadata is None else metadata,
                 geometry=GEOM, compat_hash=COMPAT_HASH)


def welcome() -> Welcome:
    return Welcome(engine_id="engine-p", agent_name="prod", agent_metadata=b"meta:prod",
                   geometry=GEOM, compat_hash=COMPAT_HASH, side_channel_ports=(1,))


class Server:
    """A SideChannelServer on an ephemeral port that welcomes every Hello and records all."""

    def __init__(self, secret: bytes | None = None, max_connections: int = 1024,
                 timeout: float = TIMEOUT):
        self.hellos: list[Hello] = []
        self.rejects: list[tuple[str, str]] = []
        self.closed: list[str] = []
        self.codec = Codec(secret)
        self.server = SideChannelServer(
            "127.0.0.1", 0, self.codec, on_hello=self._on_hello,
            on_reject=lambda reason, detail: self.rejects.append((reason, detail)),
            timeout=timeout, on_closed=lambda h: self.closed.append(h.agent_name),
            max_connections=max_connections).start()
        self.port = self.server.port

    def _on_hello(self, h: Hello) -> Welcome:
        self.hellos.append(h)
        return welcome()

    def reasons(self) -> list[str]:
        return [r for r, _ in self.rejects]

    def wait_reasons(self, n: int) -> list[str]:
        deadline = time.monotonic() + TIMEOUT
        while len(self.rejects) < n and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.reasons()

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def servers():
    made: list[Server] = []

    def make(**kw) -> Server:
        made.append(Server(**kw))
        return made[-1]
    yield make
    for s in made:
        s.close()


def raw_exchange(port: int, codec: Codec, frame_for) -> tuple[bytes, bytes, object]:
    """Connect, read the Challenge, send ``frame_for(challenge)`` (encoded bytes) and read the
    reply; returns (challenge frame, the frame sent, reply message)."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
        n = int.from_bytes(s.recv(4, socket.MSG_WAITALL), "big")
        raw_challenge = s.recv(n, socket.MSG_WAITALL)
        challenge = codec.decode(raw_challenge)
        assert isinstance(challenge, Challenge)
        frame = frame_for(challenge)
        s.sendall(len(frame).to_bytes(4, "big") + frame)
        reply = recv_frame(s, codec)
    return raw_challenge, frame, reply


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "secret"])
def test_handshake_binds_both_nonces(servers, secret):
    srv = servers(secret=secret)
    codec = Codec(secret)
    w = handshake("127.0.0.1", srv.port, hello(), codec, TIMEOUT)
    (h,) = srv.hellos
    assert len(h.nonce) == 16 and len(h.reply_to) == 16 and h.nonce != h.reply_to
    assert w.reply_to == h.nonce  # the Welcome answers this Hello
    handshake("127.0.0.1", srv.port, hello(), codec, TIMEOUT)
    assert srv.hellos[1].nonce != h.nonce and srv.hellos[1].reply_to != h.reply_to  # fresh


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "secret"])
def test_recorded_hello_is_refused_in_a_new_handshake(servers, secret):
    srv = servers(secret=secret)
    codec = Codec(secret)

    def answer(ch: Challenge) -> bytes:
        return codec.encode(replace(hello("victim"), nonce=b"n" * 16, reply_to=ch.nonce))

    _, recorded, reply = raw_exchange(srv.port, codec, answer)
    assert isinstance(reply, Welcome) and len(srv.hellos) == 1
    _, _, reply = raw_exchange(srv.port, codec, lambda ch: recorded)  # replayed as is
    assert isinstance(reply, Refused) and "replayed" in reply.reason
    assert len(srv.hellos) == 1  # the producer never acted on it
    assert "replayed" in srv.wait_reasons(1)


def test_recorded_welcome_is_refused_by_the_decoder(servers):
    """Someone who recorded a whole exchange (Challenge, Welcome) plays the producer."""
    srv = servers(secret=SECRET)
    codec = Codec(SECRET)

    def answer(ch: Challenge) -> bytes:
        return codec.encode(replace(hello(), nonce=b"m" * 16, reply_to=ch.nonce))

    raw_challenge, _, reply = raw_exchange(srv.port, codec, answer)
    assert isinstance(reply, Welcome) and reply.reply_to == b"m" * 16
    recorded_welcome = codec.encode(reply)
    fake = socket.create_server(("127.0.0.1", 0))
    port = fake.getsockname()[1]

    def impostor() -> None:
        conn, _ = fake.accept()
        with conn:
            conn.sendall(len(raw_challenge).to_bytes(4, "big") + raw_challenge)
            recv_frame(conn, codec)  # the decoder's fresh Hello
            conn.sendall(len(recorded_welcome).to_bytes(4, "big") + recorded_welcome)
            time.sleep(0.2)

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    try:
        with pytest.raises(HandshakeError, match="replayed"):
            handshake("127.0.0.1", port, hello(), codec, TIMEOUT)
    finally:
        t.join(TIMEOUT)
        fake.close()


@pytest.mark.parametrize("p_secret,d_secret,p_says,d_says", [
    (SECRET, None, "unauthenticated: the decoder at 127.0.0.1:{port} has no shared secret but "
     "this producer has one", "secret_mismatch: the producer at 127.0.0.1:{sport} uses a shared "
     "secret but this decoder has none"),
    (None, SECRET, "secret_mismatch: the decoder at 127.0.0.1:{port} uses a shared secret but "
     "this producer has none", "unauthenticated: the producer at 127.0.0.1:{sport} has no "
     "shared secret but this decoder has one"),
    (SECRET, b"another-secret", "bad_mac: the decoder at 127.0.0.1:{port} uses another shared "
     "secret", "bad_mac: the producer at 127.0.0.1:{sport} uses another shared secret"),
], ids=["only_producer", "only_decoder", "different"])
def test_secret_on_one_side_only_is_refused_by_both(servers, p_secret, d_secret, p_says, d_says):
    """Today a producer without a secret ignores a decoder's MAC. Both sides now refuse, each
    saying why, and neither side's metadata goes to the other."""
    srv = servers(secret=p_secret)
    with pytest.raises(HandshakeError) as e:
        handshake("127.0.0.1", srv.port, hello(), Codec(d_secret), TIMEOUT)
    msg = str(e.value)
    assert d_says.format(sport=srv.port) in msg and "refused" in msg
    assert srv.hellos == []  # the producer never saw the decoder's Hello (nor sent a Welcome)
    assert srv.wait_reasons(1) == [p_says.partition(":")[0]]  # P counted D's refusal
    reason, detail = srv.rejects[0]
    assert p_says.partition(": ")[2].split("{port}")[1] in detail
    if reason != "bad_mac":
        assert "KV_PUSH_SECRET" in msg and "KV_PUSH_SECRET" in detail
    for text in (msg, detail):
        assert SECRET.decode() not in text and "another-secret" not in text


def test_side_channel_connections_are_capped(servers):
    srv = servers(max_connections=2, timeout=TIMEOUT)
    idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT) for _ in range(2)]
    try:
        for s in idle:  # each holds a slot: its Challenge came, no Hello goes back
            assert s.recv(4, socket.MSG_WAITALL)
        with pytest.raises(HandshakeError, match="side_channel_full"):
            handshake("127.0.0.1", srv.port, hello(), Codec(), TIMEOUT)
        assert srv.wait_reasons(1) == ["side_channel_full"]
        assert srv.hellos == []
    finally:
        for s in idle:
            s.close()
    # the slots come back when those connections end
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            handshake("127.0.0.1", srv.port, hello(), Codec(), TIMEOUT)
            break
        except HandshakeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    assert len(srv.hellos) == 1


def test_lifelines_count_against_the_cap(servers):
    srv = servers(max_connections=1)
    lifeline_closed = threading.Event()
    handshake("127.0.0.1", srv.port, hello(), Codec(), TIMEOUT,
              on_closed=lambda w: lifeline_closed.set())
    with pytest.raises(HandshakeError, match="side_channel_full"):
        handshake("127.0.0.1", srv.port, hello("other"), Codec(), TIMEOUT)
    assert not lifeline_closed.is_set()  # the first decoder's lifeline is still held
    assert [h.agent_name for h in srv.hellos] == ["dec"]


def test_max_side_channel_connections_reaches_the_producer_worker():
    wire = Wire()
    w = PushWorker(geometry=GEOM, role="producer",
                   config=PushConfig(side_channel_port=0, max_side_channel_connections=1),
                   transport_factory=lambda: FakeTransport(wire, "P")).start()
    try:
        host, port = w.side_channel_address
        lifeline = socket.create_connection((host, port), timeout=TIMEOUT)
        assert lifeline.recv(4, socket.MSG_WAITALL)
        with pytest.raises(HandshakeError, match="side_channel_full"):
            handshake(host, port, hello(), Codec(), TIMEOUT)
        assert w.counters.get("rejected", label="side_channel_full") == 1
        lifeline.close()
    finally:
        w.close()


def test_a_hello_naming_another_agent_cannot_drop_it():
    """Today a peer can name a victim agent in its Hello (with its own metadata) and hang up:
    the producer drops the victim. The name must be the one NIXL reports for the metadata."""
    wire = Wire()
    w = PushWorker(geometry=GEOM, role="producer", config=PushConfig(side_channel_port=0),
                   transport_factory=lambda: FakeTransport(wire, "P")).start()
    attacker_t = FakeTransport(wire, "attacker")
    try:
        host, port = w.side_channel_address
        lost = threading.Event()
        handshake(host, port, hello("victim"), Codec(), TIMEOUT, on_closed=lambda _: lost.set())
        peers = lambda: w.thread.call(lambda: set(w.thread.peers), TIMEOUT)  # noqa: E731
        assert peers() == {"victim"}
        with pytest.raises(HandshakeError, match="name_mismatch"):
            handshake(host, port, hello("victim", metadata=attacker_t.metadata()), Codec(),
                      TIMEOUT, on_closed=lambda _: None)
        assert w.counters.get("rejected", label="name_mismatch") == 1
        time.sleep(0.1)  # a wrongly held lifeline would be closed by now (the attacker left)
        assert peers() == {"victim"} and not lost.is_set()
        # the attacker's metadata was not left loaded either
        assert w.thread.call(lambda: set(w.thread.transport.peers), TIMEOUT) == {"victim"}
    finally:
        w.close()


# -- the secret never shows ------------------------------------------------------------------------


def test_the_secret_never_appears_in_reprs_errors_or_logs(servers, caplog, tmp_path):
    key = "do-not-log-me-0xC0FFEE"
    caplog.set_level(logging.DEBUG)
    env = {"KV_PUSH_SECRET": key}
    config = PushConfig.from_sources({"heartbeat_interval_s": 1}, env=env)
    signer = TransferParamsSigner.from_env(env)
    texts = [repr(config), str(config), repr(signer), repr(Codec(key.encode())),
             str(signer.sign({"transfer_id": "t", "do_remote_decode": True}))]
    # every way the secret can be wrong, at the side channel and on notifications
    for p_secret, d_secret in ((key.encode(), None), (None, key.encode()),
                               (key.encode(), b"x" + key.encode())):
        srv = servers(secret=p_secret)
        with pytest.raises(HandshakeError) as e:
            handshake("127.0.0.1", srv.port, hello(), Codec(d_secret), TIMEOUT)
        texts.append(str(e.value))
        srv.wait_reasons(1)
        texts.extend(d for _, d in srv.rejects)
    h = Harness(secret=key.encode())
    try:
        h.connect_b()
        h.b.send_notif("A", Codec(b"wrong").encode(reg_msg()))
        h.b.send_notif("A", Codec().encode(reg_msg()))
        frame = h.b_send(reg_msg())
        h.b.send_notif("A", frame)
        sync(h.t)
        assert h.rejected("bad_mac") == h.rejected("unauthenticated") == h.rejected("replay") == 1
    finally:
        h.close()
    for bad in ({"secret": key}, {"secret_file": str(tmp_path / "nope")}):
        with pytest.raises(Exception) as e:
            PushConfig.from_sources(bad, env=env)
        texts.append(str(e.value))
    texts.extend(r.getMessage() for r in caplog.records)
    texts.extend(str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    assert any("rejected message" in t for t in texts)  # the logs were captured
    for t in texts:
        assert key not in t, t


def test_load_secret_sources(tmp_path):
    f = tmp_path / "k"
    f.write_text("from-file\n")
    assert load_secret({}) == b""
    assert load_secret({"KV_PUSH_SECRET": "v"}) == b"v"
    assert load_secret({}, secret_file=str(f)) == b"from-file"
    assert load_secret({"KV_PUSH_SECRET_FILE": str(f)}) == b"from-file"


def test_chunked_writes_to_one_decoder_stay_inside_the_replay_window(monkeypatch):
    """Two transfers to one decoder, each posted in many more chunks than the replay window, the
    chunks of both interleaved: each chunk's notice is numbered when it is posted, so none falls
    behind the window (numbered when planned, the second transfer's numbers would overtake the
    first's by a whole transfer)."""
    from kv_push.common import auth

    monkeypatch.setattr(auth, "REPLAY_WINDOW", 16)
    wire = Wire()
    p = PushWorker(geometry=GEOM, role="producer",
                   config=PushConfig(side_channel_port=0, secret=SECRET, max_post_regions=1),
                   transport_factory=lambda: FakeTransport(wire, "P")).start()
    d = PushWorker(geometry=GEOM, role="decoder", config=PushConfig(secret=SECRET),
                   transport_factory=lambda: FakeTransport(wire, "D")).start()
    try:
        n = GEOM.num_blocks * GEOM.block_size
        src, dst = list(range(GEOM.num_blocks)), list(reversed(range(GEOM.num_blocks)))
        for i in range(2):  # reversed destination blocks: no two regions merge, 32 per transfer
            d.expect(f"k{i}", f"t{i}", 0, p.side_channel_address, dst, 0, n)
        deadline = time.monotonic() + TIMEOUT
        while p.counters.get("registrations_early") < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        for i in range(2):
            p.prefill_done(f"p{i}", f"t{i}", src, n)
        outcomes = []
        while len(outcomes) < 2 and time.monotonic() < deadline + TIMEOUT:
            outcomes += d.drain_outcomes()
            time.sleep(0.005)
        assert sorted((o.key, o.kind) for o in outcomes) == [("k0", "received"),
                                                              ("k1", "received")], outcomes
        assert p.counters.get("writes_posted") == 2 * 32 > 16
        assert d.counters.get("rejected", label="replay") == 0
    finally:
        d.close()
        p.close()
