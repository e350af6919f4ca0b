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

The connection then stays open as a **lifeline**: each side blocks on it (with TCP keep-alive)
and reports the peer lost when it closes. When a process dies -- kill -9 included -- its kernel
closes the socket at once, so death is seen in milliseconds even while the peer's Python threads
would be too busy to heartbeat. Heartbeats still cover hung processes and lost networks.
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import struct
import threading
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
    Welcome,
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


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise HandshakeError("peer closed the side channel mid-frame")
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, codec: Codec, msg: Message) -> None:
    data = codec.encode(msg)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_frame(sock: socket.socket, codec: Codec) -> Message:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_MESSAGE_BYTES:
        raise MessageRejected("oversize", f"side-channel frame of {n} bytes")
    return codec.decode(_recv_exact(sock, n))


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def hold_lifeline(sock: socket.socket, on_closed: Callable[[], None]) -> None:
    """Block until the peer closes ``sock`` (or it breaks), then call ``on_closed``."""
    sock.settimeout(None)
    _keepalive(sock)
    try:
        while sock.recv(64):
            pass  # nothing is sent on a lifeline; ignore anything that is
    except OSError:
        pass
    finally:
        sock.close()
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
              on_open: Callable[[Callable[[], None]], None] | None = None) -> Welcome:
    """Decoder side: introduce ourselves to the producer worker at host:port.

    ``hello``'s ``nonce`` and ``reply_to`` are filled in here. With ``on_closed`` the connection
    stays open as a lifeline, watched by a daemon thread that calls ``on_closed(welcome)`` when
    the producer goes away; ``on_open`` (if given) first gets a callable that severs that
    lifeline from our side.
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
        threading.Thread(target=hold_lifeline, args=(sock, lambda: on_closed(reply)),
                         name=f"kv-push-lifeline-{host}:{port}", daemon=True).start()
    return reply


class SideChannelServer:
    """Producer side: answers handshakes with ``on_hello(hello) -> Welcome`` (which may raise).

    ``on_hello`` sees only a Hello that answers this connection's challenge (and, with a secret,
    is authenticated); the Welcome it returns gets the Hello's nonce in ``reply_to`` here."""

    def __init__(self, host: str, port: int, codec: Codec, on_hello: Callable[[Hello], Welcome],
                 on_reject: Callable[[str, str], None], timeout: float,
                 on_closed: Callable[[Hello], None] | None = None, max_connections: int = 1024):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        codec_, on_hello_, on_reject_, timeout_ = codec, on_hello, on_reject, timeout
        on_closed_ = on_closed

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                sock.settimeout(timeout_)
                peer = f"{self.client_address[0]}:{self.client_address[1]}"
                nonce = os.urandom(NONCE_BYTES)
                try:
                    send_frame(sock, codec_, Challenge(nonce=nonce))
                    try:
                        msg = recv_frame(sock, codec_)
                    except MessageRejected as e:
                        raise _explained(e, f"the decoder at {peer}", "producer") from None
                    if isinstance(msg, Refused):
                        on_reject_("peer_refused", f"decoder at {peer} refused the handshake: "
                                   f"{msg.reason}")
                        return
                    if not isinstance(msg, Hello):
                        raise MessageRejected("unexpected", f"{type(msg).__name__} on side channel")
                    if msg.reply_to != nonce:
                        raise MessageRejected("replayed", "the Hello does not answer this "
                                              "connection's challenge (recorded elsewhere?)")
                    if len(msg.nonce) != NONCE_BYTES:
                        raise MessageRejected("invalid", f"Hello nonce of {len(msg.nonce)} bytes")
                    reply: Message = msgspec.structs.replace(on_hello_(msg), reply_to=msg.nonce)
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
                    return
                if isinstance(reply, Welcome) and on_closed_ is not None:
                    hold_lifeline(sock, lambda: on_closed_(msg))  # this handler thread waits

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

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
