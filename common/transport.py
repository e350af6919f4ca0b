"""The transport seam: the few NIXL operations the push protocol needs.

A ``Transport`` moves bytes between registered memory of two processes and carries small
notifications beside them. The protocol (``transfer_thread``, ``producer``, ``decoder``) uses
nothing else of NIXL, so a new transport (another NIXL backend, a test double, a different
library) is one class with the members of ``Transport``. ``NixlTransport`` is the real one.

Lifecycle
---------
1. Construct (creates the agent; may raise ``TransportError``).
2. ``register`` the KV memory, once per set of regions, before any ``metadata()`` is handed out
   (the metadata describes the registered memory to peers).
3. ``metadata()`` for the handshake; the peer passes it to its ``add_peer`` and gets back this
   transport's ``agent_name``.
4. Per peer: ``add_peer`` (idempotent), later ``remove_peer`` (the peer died or said goodbye).
5. Per transfer: ``write`` -> ``poll`` until not "PROC" -> (``failure_reason`` if "ERR") ->
   ``release``. Control messages: ``send_notif`` / ``get_notifs``.
6. ``close`` once; nothing is called after it.

Failure model
-------------
* Set-up and handshake steps raise ``TransportError`` with a message an operator can act on:
  construction, ``register``, ``metadata``, ``add_peer``. Their callers run at start-up or
  inside a handshake, where an exception fails exactly that step.
* Everything on the transfer path returns failures as values and never raises:
  ``write`` returns a handle that polls "ERR" when the WRITE could not be posted (unknown peer,
  bad descriptors, NIXL refused it), ``poll`` returns "ERR" when the transfer failed or cannot be
  queried, ``failure_reason`` says why, ``send_notif`` returns False, ``get_notifs`` returns no
  notifications when the agent cannot be polled (a peer then looks silent and the liveness check
  declares it dead), ``remove_peer``, ``release`` and ``close`` log and carry on.

Threading model
---------------
* One owner thread calls every method of one ``Transport`` (NIXL agents run with thread-sync
  NONE and are not safe to share). Other threads hand work to the owner thread
  (``TransferThread.submit`` / ``call``). The constructing thread may ``register`` before it
  hands the transport to the owner thread (thread start orders the two).
* Progress: NIXL over UCX makes progress only when someone calls into the agent, on both sides
  (measured here: a WRITE did not complete while the target slept). The owner thread therefore
  calls ``get_notifs`` and ``poll`` continuously while work is in flight, on both sides, and an
  implementation may make progress inside any of its methods.

Completion
----------
"DONE" on the initiator does not prove the bytes are at the target (seen with LIBFABRIC); the
notification attached to the WRITE is what the target waits for: it is delivered through the
target's ``get_notifs`` only after the WRITE's bytes are in place.

``first_call_waits_for_peer``
-----------------------------
True when the first ``write``/``send_notif`` to a peer blocks until that peer's own handshake
arrives (NIXL LIBFABRIC from 1.4.0, up to a compiled-in 60 s, with or without the progress
thread); the transfer thread then sends unsolicited messages (heartbeats, goodbyes) only to peers
it has heard from. A transport without it is False.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Literal, Protocol, Sequence

import numpy as np

from .nixl_compat import libfabric_waits_for_handshake, local_nixl_version

logger = logging.getLogger(__name__)

#: What ``Transport.poll`` returns: in progress, completed, or failed.
XferState = Literal["PROC", "DONE", "ERR"]


class TransportError(RuntimeError):
    """A set-up or handshake step of a transport failed (see the module's failure model)."""


class Transport(Protocol):
    """What the push protocol needs from a transport. Read the module docstring first."""

    #: This side's name as peers know it: ``add_peer`` on a peer returns it, and it is the
    #: sender a peer's ``get_notifs`` reports for notifications from this transport.
    agent_name: str
    #: The NIXL release underneath ("" for a transport that is not NIXL); compared at the
    #: handshake (``nixl_compat.check_peer_nixl``).
    nixl_version: str
    #: See the module docstring: unsolicited messages go only to peers heard from when True.
    first_call_waits_for_peer: bool

    def register(self, regions: Sequence[tuple[int, int]], mem_type: str, dev_id: int) -> None:
        """Make local memory a source or target of transfers.

        Args:
            regions: ``(address, length)`` pairs in bytes, in this process's address space.
            mem_type: the NIXL memory type: "DRAM" (host) or "VRAM" (device memory).
            dev_id: device ordinal of the regions (0 for host memory).

        Raises:
            TransportError: the memory cannot be registered (wrong type, unmapped, no backend
                that can register it).
        """
        ...

    def metadata(self) -> bytes:
        """This side's connection information, opaque to the caller, for a peer's ``add_peer``.

        Returns:
            Bytes that describe the agent and its registered memory; call after ``register``.

        Raises:
            TransportError: the agent cannot produce its metadata.
        """
        ...

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's ``metadata()`` so that this side can write to it and notify it.

        Idempotent: adding the same peer again returns the same name.

        Args:
            metadata: what the peer's ``metadata()`` returned (received in the handshake).

        Returns:
            The peer's ``agent_name``: the name every other per-peer method takes.

        Raises:
            TransportError: the metadata is malformed or the peer cannot be loaded.
        """
        ...

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (it died or said goodbye). Unknown names are ignored; never raises.

        Args:
            peer: a name ``add_peer`` returned.
        """
        ...

    def write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, src_mem: str, dst_mem: str,
        notif: bytes,
    ) -> Any:
        """Post one WRITE of local regions into a peer's registered memory; never raises.

        Args:
            peer: a name ``add_peer`` returned.
            src: ``(N, 3)`` uint64 rows ``[address, length, dev_id]`` of registered local memory.
            dst: ``(N, 3)`` uint64 rows of the peer's registered memory; row i of ``src`` is
                copied to row i of ``dst`` (same lengths).
            src_mem: NIXL memory type of ``src`` ("DRAM" or "VRAM").
            dst_mem: NIXL memory type of ``dst``.
            notif: delivered to the peer's ``get_notifs`` once every byte has arrived.

        Returns:
            An opaque handle for ``poll``, ``failure_reason`` and ``release``. A WRITE that
            could not be posted (unknown peer, bad descriptors, refused) still gives a handle:
            it polls "ERR" at once.
        """
        ...

    def poll(self, handle: Any) -> XferState:
        """State of a WRITE; drives progress. Never raises.

        Args:
            handle: what ``write`` returned, not yet released.

        Returns:
            "PROC" while in flight, "DONE" once the initiator is done with it, "ERR" when it
            failed or its state cannot be read.
        """
        ...

    def failure_reason(self, handle: Any) -> str:
        """Why a WRITE polled "ERR", for logs and ``TransferFailed``; never raises.

        Args:
            handle: what ``write`` returned, not yet released.

        Returns:
            A one-line human-readable reason.
        """
        ...

    def release(self, handle: Any) -> None:
        """Free a WRITE's resources once ``poll`` returned "DONE" or "ERR"; never raises.

        Args:
            handle: what ``write`` returned; each handle is released exactly once, never while
                it polls "PROC" (the caller waits for it to finish first).
        """
        ...

    def send_notif(self, peer: str, data: bytes) -> bool:
        """Post a small control message to a peer, without ordering against WRITEs.

        Args:
            peer: a name ``add_peer`` returned.
            data: the message (a few hundred bytes; encoded by ``messages.Codec``).

        Returns:
            True when posted, False when it could not be (unknown peer, agent error). Never
            raises. Posted is not delivered: delivery needs both sides to keep polling.
        """
        ...

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications that arrived since the last call; drives progress. Never raises.

        Returns:
            ``(sender agent_name, data)`` pairs in arrival order; empty when there are none or
            the agent cannot be polled (logged).
        """
        ...

    def close(self) -> None:
        """Remove all peers and deregister all memory; never raises. Called once, last."""
        ...


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
    """``Transport`` over a real NIXL agent (UCX by default; LIBFABRIC for EFA / Neuron).

    Args:
        name: the agent name peers will know (default: a random ``kvpush-...`` name).
        backends: NIXL backends the agent creates; all must load.
        progress_thread: let NIXL run its own progress thread (off: the owner thread's polling
            makes progress, see the module docstring).

    Raises:
        TransportError: nixl is not importable, the agent cannot be created, or a backend did
            not load.
    """

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
        self._notif_errors: set[str] = set()  # get_notifs errors already logged

    def register(self, regions: Sequence[tuple[int, int]], mem_type: str, dev_id: int) -> None:
        descs = [(int(addr), int(length), int(dev_id), "") for addr, length in regions]
        try:
            self._registered.append(self._agent.register_memory(descs, mem_type))
        except Exception as e:
            raise TransportError(f"registering {len(descs)} {mem_type} region(s) failed: {e}") from e

    def metadata(self) -> bytes:
        try:
            return bytes(self._agent.get_agent_metadata())
        except Exception as e:
            raise TransportError(f"reading this NIXL agent's metadata failed: {e}") from e

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
            self.release(handle)
            return _Failed(f"posting {op} to {peer}: {e}")
        if state == "ERR":
            self.release(handle)
            return _Failed(f"posting {op} to {peer} returned ERR")
        return handle

    def write(self, peer, src, dst, src_mem, dst_mem, notif):
        return self._xfer("WRITE", peer, src, dst, src_mem, dst_mem, notif)

    def read(self, peer, local, remote, local_mem, remote_mem, notif):
        """A READ from the peer into local memory, as ``write`` in reverse (same handle, same
        failure model). Not part of the ``Transport`` seam -- push never reads; the benchmarks'
        pull-model comparison uses it."""
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

    def failure_reason(self, handle) -> str:
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
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as e:  # polled in a loop: log each distinct error once
            if str(e) not in self._notif_errors:
                self._notif_errors.add(str(e))
                logger.warning("kv_push: polling NIXL notifications failed: %s", e)
            return []
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
