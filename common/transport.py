"""The transport seam: the few NIXL operations the push protocol needs.

Contract
--------
* Threading: one owner thread calls every method of one ``Transport`` (NIXL agents run with
  thread-sync NONE and are not safe to share). Other threads hand work to the owner thread.
* Lifecycle: construct -> ``register`` the KV memory once -> ``metadata()`` for the handshake ->
  ``add_peer`` per peer (idempotent) -> ``write`` / ``poll`` / ``release`` per transfer ->
  ``close``.
* Failures: set-up errors (agent creation, registration, loading a peer) raise
  ``TransportError`` with a clear message. Per-transfer failures are values: ``write`` returns a
  handle whose state may be ``ERR``; ``poll`` returns "PROC", "DONE" or "ERR";
  ``send_notif`` returns False when the notification could not be posted. Nothing on the
  transfer path raises into the engine.
* Progress: NIXL over UCX makes progress only when someone calls into the agent, on both sides
  (measured here: a WRITE did not complete while the target slept). The owner thread therefore
  polls ``get_notifs`` and ``poll`` continuously while work is in flight, on both sides.
* Completion: "DONE" on the initiator does not prove the bytes are at the target (seen with
  LIBFABRIC); the notification attached to the WRITE is what the target waits for.
* ``first_call_waits_for_peer``: True when the first ``write``/``send_notif`` to a peer blocks
  until that peer's own handshake arrives (NIXL LIBFABRIC from 1.4.0, up to a compiled-in 60 s,
  with or without the progress thread); the transfer thread then sends unsolicited messages
  (heartbeats, goodbyes) only to peers it has heard from. A transport without it is False.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Protocol, Sequence

import numpy as np

from .nixl_compat import libfabric_waits_for_handshake, local_nixl_version

logger = logging.getLogger(__name__)


class TransportError(RuntimeError):
    pass


class Transport(Protocol):
    agent_name: str
    nixl_version: str  # the NIXL release underneath ("" for a transport that is not NIXL)

    def register(self, regions: Sequence[tuple[int, int]], mem_type: str, dev_id: int) -> None: ...

    def metadata(self) -> bytes: ...

    def add_peer(self, metadata: bytes) -> str: ...

    def remove_peer(self, peer: str) -> None: ...

    def write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, src_mem: str, dst_mem: str,
        notif: bytes,
    ) -> Any: ...

    def read(
        self, peer: str, local: np.ndarray, remote: np.ndarray, local_mem: str, remote_mem: str,
        notif: bytes,
    ) -> Any: ...

    def poll(self, handle: Any) -> str: ...

    def release(self, handle: Any) -> None: ...

    def send_notif(self, peer: str, data: bytes) -> bool: ...

    def get_notifs(self) -> list[tuple[str, bytes]]: ...

    def close(self) -> None: ...


def _nixl_api():
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise TransportError(
            "the nixl package is not importable; install nixl==1.5.1 (pip install 'kv-push[nixl]')"
        ) from e
    return nixl_agent, nixl_agent_config


class _Failed:
    """A write that could not be posted: polls as ERR, carries the reason."""

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"<failed write: {self.reason}>"


class NixlTransport:
    """``Transport`` over a real NIXL agent (UCX by default; LIBFABRIC for EFA / Neuron)."""

    def __init__(
        self,
        name: str | None = None,
        backends: Sequence[str] = ("UCX",),
        progress_thread: bool = False,
    ):
        nixl_agent, nixl_agent_config = _nixl_api()
        self.agent_name = name or f"kvpush-{uuid.uuid4().hex[:12]}"
        self.nixl_version = local_nixl_version()
        self._backends = list(backends)
        try:
            self._agent = nixl_agent(
                self.agent_name,
                nixl_agent_config(enable_prog_thread=progress_thread, backends=self._backends),
            )
        except Exception as e:  # the bindings raise plain exceptions
            raise TransportError(f"cannot create NIXL agent with {self._backends}: {e}") from e
        missing = [b for b in self._backends if b not in self._agent.backends]
        if missing:
            raise TransportError(
                f"NIXL backend(s) {missing} did not load (available plugins: "
                f"{self._agent.get_plugin_list()}); check the NIXL install and its libraries"
            )
        self._registered: list[Any] = []
        self._peers: set[str] = set()
        self.first_call_waits_for_peer = ("LIBFABRIC" in self._backends
                                          and libfabric_waits_for_handshake(local_nixl_version()))

    def register(self, regions: Sequence[tuple[int, int]], mem_type: str, dev_id: int) -> None:
        descs = [(int(addr), int(length), int(dev_id), "") for addr, length in regions]
        try:
            self._registered.append(self._agent.register_memory(descs, mem_type))
        except Exception as e:
            raise TransportError(f"registering {len(descs)} {mem_type} region(s) failed: {e}") from e

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise TransportError(f"loading a peer's NIXL metadata failed: {e}") from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers.add(name)
        return name

    def remove_peer(self, peer: str) -> None:
        if peer in self._peers:
            self._peers.discard(peer)
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as e:  # already gone on the NIXL side: nothing else to do
                logger.warning("kv_push: removing NIXL peer %s: %s", peer, e)

    def _xfer(self, op, peer, local, remote, local_mem, remote_mem, notif):
        if peer not in self._peers:
            return _Failed(f"unknown peer {peer}")
        try:
            ldescs = self._agent.get_xfer_descs(np.ascontiguousarray(local, np.uint64), local_mem)
            rdescs = self._agent.get_xfer_descs(np.ascontiguousarray(remote, np.uint64), remote_mem)
            handle = self._agent.initialize_xfer(op, ldescs, rdescs, peer, notif)
        except Exception as e:
            return _Failed(f"preparing {op} to {peer}: {e}")
        try:
            state = self._agent.transfer(handle)
        except Exception as e:
            self._agent.release_xfer_handle(handle)
            return _Failed(f"posting {op} to {peer}: {e}")
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            return _Failed(f"posting {op} to {peer} returned ERR")
        return handle

    def write(self, peer, src, dst, src_mem, dst_mem, notif):
        return self._xfer("WRITE", peer, src, dst, src_mem, dst_mem, notif)

    def read(self, peer, local, remote, local_mem, remote_mem, notif):
        return self._xfer("READ", peer, local, remote, local_mem, remote_mem, notif)

    def poll(self, handle) -> str:
        if isinstance(handle, _Failed):
            return "ERR"
        try:
            return self._agent.check_xfer_state(handle)
        except Exception as e:
            logger.warning("kv_push: polling a NIXL transfer failed: %s", e)
            return "ERR"

    def release(self, handle) -> None:
        if isinstance(handle, _Failed):
            return
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:  # a handle still in flight cannot be released: log, keep going
            logger.warning("kv_push: releasing a NIXL transfer handle failed: %s", e)

    @staticmethod
    def failure_reason(handle) -> str:
        return handle.reason if isinstance(handle, _Failed) else "transfer reported ERR"

    def send_notif(self, peer: str, data: bytes) -> bool:
        if peer not in self._peers:
            return False
        try:
            self._agent.send_notif(peer, data)
            return True
        except Exception as e:
            logger.warning("kv_push: notification to %s failed: %s", peer, e)
            return False

    def get_notifs(self) -> list[tuple[str, bytes]]:
        notifs = self._agent.get_new_notifs()
        out = []
        for peer, msgs in notifs.items():
            peer = peer.decode() if isinstance(peer, bytes) else peer
            out.extend((peer, m) for m in msgs)
        return out

    def close(self) -> None:
        for peer in list(self._peers):
            self.remove_peer(peer)
        for reg in self._registered:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                logger.warning("kv_push: deregistering KV memory failed: %s", e)
        self._registered.clear()
        self._agent = None
