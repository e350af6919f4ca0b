"""The handshake side channel: a decoder worker introduces itself to a producer worker.

A producer worker listens on ``side_channel_port + tp_rank``. A decoder worker that needs it
connects; the producer sends ``Challenge`` (a fresh nonce), the decoder answers ``Hello`` (its
engine id, NIXL agent metadata and KV geometry, the challenge's nonce in ``reply_to`` and a fresh
``nonce`` of its own) and gets back ``Welcome`` (the same of the producer, plus every producer
rank's port, with the decoder's nonce in ``reply_to``) or ``Refused``. After that both agents
know each other and everything else travels as NIXL notifications. One TCP round trip after
the connect replaces NIXL's own metadata listener, which polls every 100 ms (measured here:
0.12-0.32 s against ~15 ms for a plain socket).

Frames are a 4-byte big-endian length and one encoded ``Envelope`` (so the secret, when
configured, authenticates the handshake too). The nonces make a recorded Hello or Welcome
useless in another handshake. A secret set on one side only is refused by both sides with the
reason (the side that notices first sends ``Refused`` before closing, so the other counts it
too). Every socket operation has a time-out: a peer that hangs costs its own handshake thread,
never the transfer thread. A listener serves at most ``max_connections`` connections at once
(handshakes and lifelines together); more are refused and counted (``side_channel_full``).

The router uses the same listener for one more thing: **releasing** prefills nobody will claim
(``Release``, protocol 4). When an exchange ends without decode output (the client went away
before D's first byte, D failed, P's leg failed) D's engine may never have seen the request, so
no decoder will ever register for it or cancel it, and P would hold the prompt's KV until
``rendezvous_ttl_s``. The router connects (``release``), gets the ``Challenge``, sends
``Release(transfer_ids, reply_to=nonce)`` and gets ``ReleaseAck`` (every producer rank's port:
each rank holds its own copy, so the router then tells the other ranks) or ``Refused``; the
connection then closes (one Release per connection, no lifeline). With a secret the frame is
MAC'd and the MAC binds the nonce of this connection: a recorded Release is refused
(``replayed``) on any other connection. Without a secret anyone who reaches the port can release
(that is: make P free prefills early, so D prefills those prompts locally or fails them per its
``kv_load_failure_policy``) -- no more than the NIXL metadata this port hands out already allows.
The server hands a Release to ``on_release`` (which must only enqueue: the worker passes it to its
transfer thread) and counts refused ones through ``on_release_reject`` (the frame's claimed kind
picks that counter even when it cannot be authenticated).

The connection then stays open as a **lifeline**: each side blocks on it (with TCP keep-alive)
and reports the peer lost when it closes. When a process dies -- kill -9 included -- its kernel
closes the socket at once, so death is seen in milliseconds even while the peer's Python threads
would be too busy to heartbeat. Heartbeats still cover hung processes and lost networks.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Collection
from typing import Callable

import msgspec

from .messages import (
    MAX_MESSAGE_BYTES,
    NONCE_BYTES,
    Challenge,
    Codec,
    Hello,
    Message,
    MessageRejected,
    Refused,
    Release,
    ReleaseAck,
    Welcome,
    peek_kind,
    unverified_challenge,
)

logger = logging.getLogger(__name__)

_LEN = struct.Struct("!I")


class HandshakeError(ConnectionError):
    pass


class HandshakeRefused(HandshakeError):
    """One side refused the other: the two cannot work together as configured. ``reason`` is
    ``label: sentence`` (e.g. "bad_layout: ... opaque block layouts need equal block_size ...").
    ``rejected`` is the label when the refusal was decided here (this decoder rejected the
    producer's frame, e.g. ``secret_mismatch``, and told it so), ``None`` when the producer
    answered ``Refused``. Retrying will not help until one side is reconfigured."""

    def __init__(self, message: str, reason: str, rejected: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.rejected = rejected


class _Explained(HandshakeError):
    """A handshake failure whose message already names the peer and the cause."""


class ClosedBeforeFrame(HandshakeError):
    """The peer closed the connection before sending a byte of its frame."""


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:  # the whole frame within the socket's time-out, not each recv
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("side-channel frame not complete in time")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if not buf:
                raise ClosedBeforeFrame("peer closed the side channel before its frame")
            raise HandshakeError("peer closed the side channel mid-frame")
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, codec: Codec, msg: Message) -> None:
    data = codec.encode(msg)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_raw(sock: socket.socket) -> bytes:
    """One frame's bytes (not yet decoded). The socket's time-out bounds the whole frame: a
    peer that sends a byte now and then cannot hold a connection (and a slot of the side
    channel's ``max_side_channel_connections``) for longer."""
    budget = sock.gettimeout()
    deadline = None if budget is None else time.monotonic() + budget
    try:
        (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
        if n > MAX_MESSAGE_BYTES:
            raise MessageRejected("oversize", f"side-channel frame of {n} bytes")
        return _recv_exact(sock, n, deadline)
    finally:
        if budget is not None:
            sock.settimeout(budget)


def recv_frame(sock: socket.socket, codec: Codec) -> Message:
    return codec.decode(recv_raw(sock))


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


#: how a lifeline breaks without proof that the peer is gone: its host stopped answering (TCP
#: keepalive or retransmission timed out, no route). The peer may be alive -- a partition of the
#: side channel's network alone -- with WRITEs in flight over another path. A closed connection
#: (end of stream, reset) is proof: the peer's kernel closed it, its process is gone or let go.
UNPROVEN_ERRNOS = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH,
                             errno.EHOSTDOWN, errno.ENETDOWN})


def hold_lifeline(sock: socket.socket, on_closed: Callable[[], None],
                  on_unproven: Callable[[str], None] | None = None) -> None:
    """Block until the peer closes ``sock`` (or it breaks), then call ``on_closed``; a break
    without proof of the peer's end (``UNPROVEN_ERRNOS``) calls ``on_unproven(why)`` instead,
    where given."""
    sock.settimeout(None)
    _keepalive(sock)
    unproven = None
    try:
        while sock.recv(64):
            pass  # nothing is sent on a lifeline; ignore anything that is
    except OSError as e:
        if e.errno in UNPROVEN_ERRNOS:
            unproven = os.strerror(e.errno)
    finally:
        sock.close()
        if unproven is not None and on_unproven is not None:
            on_unproven(unproven)
        else:
            on_closed()


#: what a rejected handshake frame means, said to the operator (and to the peer in ``Refused``)
_SECRET_REASONS = {
    "unauthenticated": "{peer} has no shared secret but this {me} has one: set KV_PUSH_SECRET "
                       "(or secret_file) on both sides or neither",
    "secret_mismatch": "{peer} uses a shared secret but this {me} has none: set KV_PUSH_SECRET "
                       "(or secret_file) on both sides or neither",
    "bad_mac": "{peer} uses another shared secret (bad MAC)",
}


def explain(e: MessageRejected, peer: str, me: str) -> str:
    """A rejected handshake frame as ``reason: sentence`` for logs and ``Refused``."""
    text = _SECRET_REASONS.get(e.reason)
    return f"{e.reason}: " + (text.format(peer=peer, me=me) if text else e.detail)


def _explained(e: MessageRejected, peer: str, me: str) -> MessageRejected:
    text = _SECRET_REASONS.get(e.reason)
    return MessageRejected(e.reason, text.format(peer=peer, me=me)) if text else e


def _refuse_quietly(sock: socket.socket, codec: Codec, reason: str) -> None:
    """Tell the other side why we hang up, if it still listens."""
    try:
        send_frame(sock, codec, Refused(reason=reason))
    except OSError:
        pass


def sever(sock: socket.socket) -> None:
    """Close a lifeline from our side: the peer sees us gone (and our watcher sees it closed)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


def handshake(host: str, port: int, hello: Hello, codec: Codec, timeout: float,
              on_closed: Callable[[Welcome], None] | None = None,
              on_open: Callable[[Callable[[], None]], None] | None = None,
              on_unproven: Callable[[Welcome, str], None] | None = None) -> Welcome:
    """Decoder side: introduce ourselves to the producer worker at host:port.

    ``hello``'s ``nonce`` and ``reply_to`` are filled in here. With ``on_closed`` the connection
    stays open as a lifeline, watched by a daemon thread that calls ``on_closed(welcome)`` when
    the producer goes away (or ``on_unproven(welcome, why)``, where given, when the connection
    broke without proof of that: ``hold_lifeline``); ``on_open`` (if given) first gets a
    callable that severs that lifeline from our side.
    """
    sock = None
    where = f"{host}:{port}"
    nonce = os.urandom(NONCE_BYTES)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.settimeout(timeout)
        try:
            challenge = recv_frame(sock, codec)
        except socket.timeout:
            sock.close()
            raise _Explained(f"side channel {where}: timed out after {timeout:g}s waiting for "
                             "the producer's Challenge (hung, or older than protocol 2)") from None
        except MessageRejected as e:
            # decided here (secret on one side only, another secret, another protocol): a
            # refusal like one the producer decides, so the decoder counts it the same way
            reason = explain(e, f"the producer at {where}", "decoder")
            _refuse_quietly(sock, codec, reason)
            sock.close()
            raise HandshakeRefused(f"handshake with {where} refused here: {reason}", reason,
                                   rejected=e.reason) from None
        if isinstance(challenge, Refused):
            sock.close()
            raise _Explained(f"{where} refused the handshake: {challenge.reason}")
        if not isinstance(challenge, Challenge):
            sock.close()
            raise _Explained(f"{where} opened with {type(challenge).__name__}, not Challenge")
        hello = msgspec.structs.replace(hello, nonce=nonce, reply_to=challenge.nonce)
        send_frame(sock, codec, hello)
        reply = recv_frame(sock, codec)
    except MessageRejected as e:
        if sock is not None:
            sock.close()
        raise HandshakeError(f"bad reply from {where}: "
                             f"{explain(e, f'the producer at {where}', 'decoder')}") from None
    except (_Explained, HandshakeRefused):
        raise  # (an OSError too)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise HandshakeError(f"side channel {where}: {e}") from None
    if isinstance(reply, Refused) or not isinstance(reply, Welcome):
        sock.close()
        if isinstance(reply, Refused):
            raise HandshakeRefused(f"{where} refused the handshake: {reply.reason}", reply.reason)
        raise HandshakeError(f"{where} answered {type(reply).__name__}, not Welcome")
    if reply.reply_to != nonce:
        sock.close()
        raise HandshakeError(f"{where} answered with a Welcome for another handshake (replayed)")
    if on_closed is None:
        sock.close()
    else:
        if on_open is not None:
            on_open(lambda: sever(sock))
        unproven = None if on_unproven is None else (lambda why: on_unproven(reply, why))
        threading.Thread(target=hold_lifeline, args=(sock, lambda: on_closed(reply), unproven),
                         name=f"kv-push-lifeline-{host}:{port}", daemon=True).start()
    return reply


class ReleaseFailed(HandshakeError):
    """A ``release`` that did not go through. ``kind`` (a metrics label): ``connect`` (nobody
    listens, or the connection broke), ``timeout``, ``refused`` (the producer answered
    ``Refused``, or its Challenge could not be authenticated here; ``reason`` says why),
    ``bad_reply`` (it answered something else)."""

    def __init__(self, message: str, kind: str, reason: str = ""):
        super().__init__(message)
        self.kind, self.reason = kind, reason


def release(host: str, port: int, transfer_ids: tuple[str, ...], codec: Codec,
            timeout: float) -> ReleaseAck:
    """Router side: tell the producer worker at host:port to release ``transfer_ids`` (1 to
    ``MAX_RELEASE_IDS``). Every socket operation is bounded by ``timeout``. Returns the
    producer's ``ReleaseAck``; raises ``ReleaseFailed`` otherwise."""
    where = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            raw = recv_raw(sock)
            mismatch = None  # why the producer's frames cannot be authenticated here
            try:
                challenge = codec.decode(raw)
            except MessageRejected as e:
                if e.reason not in _SECRET_REASONS:
                    raise ReleaseFailed(f"bad challenge from {where}: {e}", "bad_reply",
                                        e.reason) from None
                # a secret on one side only, or two secrets: answer the nonce all the same, so
                # that the producer judges the Release and counts why it refuses it
                mismatch = MessageRejected(e.reason,
                                           explain(e, f"the producer at {where}", "router"))
                challenge = unverified_challenge(raw)
            if isinstance(challenge, Refused):
                raise ReleaseFailed(f"{where} refused the release: {challenge.reason}",
                                    "refused", challenge.reason)
            if not isinstance(challenge, Challenge):
                raise ReleaseFailed(f"{where} opened with "
                                    f"{type(challenge).__name__ if challenge else 'junk'}, not "
                                    "Challenge", "bad_reply")
            send_frame(sock, codec, Release(transfer_ids=tuple(transfer_ids),
                                            reply_to=challenge.nonce))
            try:
                reply = recv_frame(sock, codec)
            except MessageRejected as e:
                if mismatch is not None:  # its Refused, which we cannot authenticate either
                    raise ReleaseFailed(f"{where} refused the release: {mismatch.detail}",
                                        "refused", mismatch.reason) from None
                raise ReleaseFailed(f"bad reply from {where}: "
                                    f"{explain(e, f'the producer at {where}', 'router')}",
                                    "bad_reply", e.reason) from None
            if mismatch is not None:  # cannot happen: the producer refuses what we sent
                raise ReleaseFailed(f"release to {where}: {mismatch.detail}", "refused",
                                    mismatch.reason)
    except socket.timeout:
        raise ReleaseFailed(f"side channel {where}: timed out after {timeout:g}s",
                            "timeout") from None
    except ReleaseFailed:
        raise
    except MessageRejected as e:  # an oversize frame
        raise ReleaseFailed(f"bad reply from {where}: {e}", "bad_reply", e.reason) from None
    except OSError as e:  # HandshakeError (closed mid-frame) included
        raise ReleaseFailed(f"side channel {where}: {e}", "connect") from None
    if isinstance(reply, Refused):
        raise ReleaseFailed(f"{where} refused the release: {reply.reason}", "refused",
                            reply.reason)
    if not isinstance(reply, ReleaseAck):
        raise ReleaseFailed(f"{where} answered {type(reply).__name__}, not ReleaseAck",
                            "bad_reply")
    return reply


def _judge_challenge(raw: bytes, codec: Codec, where: str) -> str | None:
    """:func:`probe`'s verdict on the first frame a side channel sent."""
    try:
        challenge = codec.decode(raw)
    except MessageRejected as e:
        if e.reason in _SECRET_REASONS:
            return f"KV side channel {where}: {explain(e, f'the producer at {where}', 'router')}"
        return f"KV side channel {where}: not a kv_push side channel ({e})"
    if isinstance(challenge, Refused):  # e.g. max_side_channel_connections reached
        return f"KV side channel {where} refused the connection: {challenge.reason}"
    if not isinstance(challenge, Challenge):
        return f"KV side channel {where}: opened with {type(challenge).__name__}, not Challenge"
    return None


async def probe(host: str, port: int, codec: Codec, timeout: float) -> str | None:
    """Router side (``/health?probe``, and a decode failure with no refusal to explain it): is
    a producer's side channel listening at host:port and speaking this protocol with this
    codec's secret? None when it is, else what is wrong. It reads the producer's ``Challenge``
    and closes without a frame, which the producer counts as a probe (``side_channel_probes``),
    not as a failed handshake. The whole exchange, name lookup included, is bounded by
    ``timeout``, on the caller's event loop (no thread)."""
    where = f"{host}:{port}"
    connected = False

    async def read() -> bytes:
        nonlocal connected
        reader, writer = await asyncio.open_connection(host, port)
        connected = True
        try:
            (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            if n > MAX_MESSAGE_BYTES:
                raise MessageRejected("oversize", f"side-channel frame of {n} bytes")
            return await reader.readexactly(n)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    try:
        raw = await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        if connected:  # the kernel accepted: a stopped or overloaded producer looks like this
            return (f"KV side channel {where}: connected, but no challenge within {timeout:g}s "
                    "(a producer that is stopped or overloaded, or another service on that port)")
        return f"KV side channel {where}: no connection within {timeout:g}s"
    except MessageRejected as e:
        return f"KV side channel {where}: not a kv_push side channel ({e})"
    except asyncio.IncompleteReadError:
        return f"KV side channel {where}: closed before its challenge"
    except OSError as e:  # asyncio's text hides the cause ("Connect call failed")
        return f"KV side channel {where}: {os.strerror(e.errno) if e.errno else e}"
    return _judge_challenge(raw, codec, where)


class SideChannelServer:
    """Producer side: answers handshakes with ``on_hello(hello) -> Welcome`` (which may raise)
    and, with ``on_release``, the router's releases with ``on_release(release) -> ReleaseAck``.

    ``on_hello`` sees only a Hello that answers this connection's challenge (and, with a secret,
    is authenticated); the Welcome it returns gets the Hello's nonce in ``reply_to`` here. The
    same holds for ``on_release``, which must not block (hand the Release on and return).
    Refused handshakes go to ``on_reject(reason, detail)``, refused releases to
    ``on_release_reject(reason, detail)`` (``on_reject`` when not given)."""

    def __init__(self, host: str, port: int, codec: Codec, on_hello: Callable[[Hello], Welcome],
                 on_reject: Callable[[str, str], None], timeout: float,
                 on_closed: Callable[[Hello], None] | None = None, max_connections: int = 1024,
                 on_release: Callable[[Release], ReleaseAck] | None = None,
                 on_release_reject: Callable[[str, str], None] | None = None,
                 on_probe: Callable[[str], None] | None = None,
                 on_held: Callable[[Hello], None] | None = None,
                 on_unsent: Callable[[Hello], None] | None = None):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        codec_, on_hello_, on_reject_, timeout_ = codec, on_hello, on_reject, timeout
        on_closed_, on_release_, on_probe_ = on_closed, on_release, on_probe
        on_held_, on_unsent_ = on_held, on_unsent
        on_release_reject_ = on_release_reject or on_reject
        # lifelines held open (their handler threads wait in hold_lifeline): closed by close()
        lifelines: dict[socket.socket, str] = {}  # -> the decoder agent holding it
        lifelines_lock = threading.Lock()
        self._lifelines, self._lifelines_lock = lifelines, lifelines_lock
        self._lifelines_closed = False
        server_ = self

        def answer_release(msg: Release, nonce: bytes, peer: str) -> Message:
            """The reply to a decoded Release (``Refused`` for one that must not count)."""
            try:
                if on_release_ is None:
                    raise MessageRejected("unexpected", "Release on a side channel that takes "
                                          "none")
                if msg.reply_to != nonce:
                    raise MessageRejected("replayed", "the Release does not answer this "
                                          "connection's challenge (recorded elsewhere?)")
                return on_release_(msg)
            except MessageRejected as e:
                on_release_reject_(e.reason, f"release from {peer}: {e.detail}")
                return Refused(reason=str(e))
            except Exception as e:  # on_release failed: tell the router why
                logger.exception("kv_push: release from %s failed", peer)
                on_release_reject_("internal_error", f"release from {peer}: {e!r}")
                return Refused(reason=f"{type(e).__name__}: {e}")

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                sock.settimeout(timeout_)
                peer = f"{self.client_address[0]}:{self.client_address[1]}"
                nonce = os.urandom(NONCE_BYTES)
                msg: Message | None = None
                try:
                    send_frame(sock, codec_, Challenge(nonce=nonce))
                    try:
                        raw = recv_raw(sock)
                    except ClosedBeforeFrame:
                        # read the challenge and left without a word: a liveness probe (the
                        # router's /health?probe), not a failed handshake
                        if on_probe_ is not None:
                            on_probe_(peer)
                        return
                    try:
                        msg = codec_.decode(raw)
                    except MessageRejected as e:
                        if peek_kind(raw) == "release":  # what it claims to be: only a label
                            on_release_reject_(e.reason, "release from "
                                               f"{peer}: {explain(e, 'the router', 'producer')}")
                            _refuse_quietly(sock, codec_,
                                            explain(e, "the router", "producer"))
                            return
                        raise _explained(e, f"the decoder at {peer}", "producer") from None
                    if isinstance(msg, Release):
                        reply: Message = answer_release(msg, nonce, peer)
                    else:
                        if isinstance(msg, Refused):
                            on_reject_("peer_refused", f"decoder at {peer} refused the "
                                       f"handshake: {msg.reason}")
                            return
                        if not isinstance(msg, Hello):
                            raise MessageRejected("unexpected",
                                                  f"{type(msg).__name__} on side channel")
                        if msg.reply_to != nonce:
                            raise MessageRejected("replayed", "the Hello does not answer this "
                                                  "connection's challenge (recorded elsewhere?)")
                        if len(msg.nonce) != NONCE_BYTES:
                            raise MessageRejected("invalid",
                                                  f"Hello nonce of {len(msg.nonce)} bytes")
                        reply = msgspec.structs.replace(on_hello_(msg), reply_to=msg.nonce)
                except MessageRejected as e:
                    on_reject_(e.reason, f"handshake from {peer}: {e.detail}")
                    reply = Refused(reason=str(e))
                except (OSError, HandshakeError) as e:
                    on_reject_("handshake_io", f"handshake from {peer}: {e}")
                    return
                except Exception as e:  # on_hello failed: tell the decoder why
                    logger.exception("kv_push: handshake from %s failed", peer)
                    reply = Refused(reason=f"{type(e).__name__}: {e}")
                try:
                    send_frame(sock, codec_, reply)
                except OSError as e:
                    on_reject_("handshake_io", f"reply to {peer}: {e}")
                    if isinstance(reply, Welcome) and on_unsent_ is not None:
                        on_unsent_(msg)  # accepted, but it never heard so: no lifeline
                    return
                if isinstance(reply, Welcome) and on_closed_ is not None:
                    hello = msg
                    if on_held_ is not None:
                        on_held_(hello)
                    with lifelines_lock:
                        if server_._lifelines_closed:  # (closing: nothing is held any more)
                            with contextlib.suppress(OSError):
                                sock.shutdown(socket.SHUT_RDWR)
                        lifelines[sock] = hello.agent_name
                    try:  # this handler thread waits
                        hold_lifeline(sock, lambda: on_closed_(hello))
                    finally:
                        with lifelines_lock:
                            lifelines.pop(sock, None)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            # the kernel's accept queue; what is accepted beyond max_connections is refused
            request_queue_size = 128

            def __init__(self, *args, **kwargs):
                self.active = 0
                self.lock = threading.Lock()
                super().__init__(*args, **kwargs)

            def verify_request(self, request, client_address) -> bool:
                with self.lock:
                    if self.active < max_connections:
                        self.active += 1
                        return True
                on_reject_("side_channel_full", f"connection from {client_address[0]}:"
                           f"{client_address[1]} refused: {max_connections} side-channel "
                           "connections open (max_side_channel_connections)")
                request.settimeout(0.1)  # never let a full listener block on a slow reader
                _refuse_quietly(request, codec_, f"side_channel_full: the producer has "
                                f"{max_connections} side-channel connections open")
                return False

            def process_request(self, request, client_address) -> None:
                try:
                    super().process_request(request, client_address)
                except BaseException:  # no thread started: give the slot back
                    with self.lock:
                        self.active -= 1
                    raise

            def process_request_thread(self, request, client_address) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    with self.lock:
                        self.active -= 1

        try:
            self._server = Server((host, port), Handler)
        except OSError as e:
            raise HandshakeError(f"cannot listen on {host}:{port} for KV handshakes: {e}") from e
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
            name="kv-push-side-channel", daemon=True,
        )

    def start(self) -> "SideChannelServer":
        self._thread.start()
        return self

    def stop_listening(self) -> None:
        """No new connections; the lifelines held stay open (``close_lifelines``)."""
        if self._thread.ident is not None:  # (shutdown() waits for a loop never started)
            self._server.shutdown()
            self._thread.join(5)
        self._server.server_close()

    def close_lifelines(self, keep: Collection[str] = ()) -> None:
        """End every lifeline held open (and any a handler is about to hold): its decoder
        learns at once that this producer is gone -- so call it only once nothing of this
        producer's can be in flight any more (its transfer thread closed: a decoder frees its
        fenced blocks when the lifeline closes). A worker closed while its process lives on
        (``server_watch``) kept them, their handler threads and connection slots, until the
        decoders died. ``keep``: decoder agents whose lifelines stay open (a WRITE to them may
        still be in flight: they end with the process)."""
        with self._lifelines_lock:
            self._lifelines_closed = True
            held = [sock for sock, agent in self._lifelines.items() if agent not in keep]
        for sock in held:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """``stop_listening``, then ``close_lifelines``."""
        self.stop_listening()
        self.close_lifelines()
