"""Memory backends: the seam, the table of backends, the host backend, and selection.

A backend is the only accelerator-specific part of the distribution: it knows how to describe and
register one worker's KV memory; everything else (protocol, rendezvous, mapping, transfers) lives
once in ``common/``. ``KVBackend`` is the contract, ``BACKENDS`` the one table of them.

Adding a backend
----------------
Write a class with the members of ``KVBackend`` in its own package (``gpu_push/backend.py`` is
the example: detection, start-up checks, device id, and a ``verify_registration`` that hands its
per-address check to ``verify_regions``), and add one entry to ``BACKENDS``. Tensor description
(``kv_tensors.describe_kv_caches``) needs nothing from a backend but ``mem_type`` and
``device_id``; the config accepts every name in ``BACKENDS``.

Staging memory (optional)
-------------------------
``alloc_staging(nbytes, dev_id) -> (address, keepalive)``: memory for a staging pool of the staged
transfer path (``staged.py``), of the backend's ``mem_type`` on device ``dev_id``, aligned to
``STAGING_ALIGN``, staying allocated while ``keepalive`` is referenced; ``BackendError`` when it
cannot. ``default_staging_bytes`` is the pool size the config's ``-1`` stands for (0: no pool
unless configured). ``PushWorker`` registers the pool next to the KV. A backend without
``alloc_staging`` never stages (the region path only); it may say why in a
``staging_unsupported`` string (where it is explained), which the worker logs and puts into the
error when a pool is configured anyway.

Lifecycle (``worker.PushWorker``, in each vLLM worker process, on the thread that builds it)
---------------------------------------------------------------------------------------------
``select_backend`` (class ``available()`` for detection, then an instance) -> ``device_id`` for
the KV tensors (while describing them) -> ``prepare`` -> the transport is created with one of
``nixl_backends`` and registers the KV regions -> ``verify_registration``. Nothing is called
after that: backends hold no state the transfer path needs.

Failure model
-------------
Everything a backend refuses is a ``BackendError`` whose message says what to change (an
environment variable, a driver, a launcher setting). It is raised at start-up only, so vLLM's
worker fails to start instead of serving with KV that cannot be transferred or, worse, with a
registration that silently moved host memory.

Choose with ``KV_PUSH_BACKEND=<name in BACKENDS>``; unset, the first entry of ``BACKENDS`` whose
``available()`` is true is used (the host backend, last, always is).
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any, Callable, Protocol

from .geometry import KVGeometry

logger = logging.getLogger(__name__)

BACKEND_ENV = "KV_PUSH_BACKEND"

#: Every memory backend, ``name -> "module:Class"``, in detection order (first available wins;
#: the host backend, last, always is). Adding a backend is one entry here.
BACKENDS = {
    "neuron": "kv_push.neuron_push.backend:NeuronBackend",
    "cuda": "kv_push.gpu_push.backend:CudaBackend",
    "host": "kv_push.common.backend:HostBackend",
}

#: The NIXL backends kv-push can drive (``PushConfig.nixl_backends`` is checked against these;
#: each memory backend says which of them can register its memory).
NIXL_BACKENDS = ("UCX", "LIBFABRIC")


class BackendError(RuntimeError):
    """The chosen backend cannot run here, or its memory is not what it claims."""


class KVBackend(Protocol):
    """What kv-push needs to know about one kind of KV memory. See the module docstring."""

    #: the name in ``BACKENDS`` and ``KV_PUSH_BACKEND``
    name: str
    #: the NIXL memory type of this backend's KV memory: "DRAM" (host) or "VRAM" (device)
    mem_type: str
    #: NIXL backends (from ``NIXL_BACKENDS``) that can register this memory, preferred first;
    #: the transport uses the first unless the config names others from this list
    nixl_backends: tuple[str, ...]
    #: whether the NIXL agent runs its own progress thread (False everywhere today: the transfer
    #: thread polls; see docs/neuron.md for why LIBFABRIC keeps it off too)
    nixl_progress_thread: bool

    @classmethod
    def available(cls) -> bool:
        """Whether this machine has the device and software this backend needs (detection).

        Returns:
            True when the backend can plausibly run here. Must be cheap, must not initialise
            a device runtime, and never raises (a missing library is False).
        """
        ...

    def prepare(self, colocated: bool = False) -> None:
        """Check, and where it is the backend's job arrange, what must hold before the NIXL
        agent is created (environment variables, runtime initialisation, transport settings).

        Args:
            colocated: prefill and decode run on this same host.

        Raises:
            BackendError: a condition does not hold; the message says how to fix it. Conditions
                that only make transfers slow are logged as warnings instead.
        """
        ...

    def device_id(self, tensor: Any) -> int:
        """The device id NIXL descriptors carry for a KV tensor of this backend.

        Args:
            tensor: one of the KV cache tensors vLLM hands the connector (a torch tensor, or a
                duck-typed stand-in in tests).

        Returns:
            The device ordinal (0 for host memory).

        Raises:
            BackendError: the tensor is not in this backend's memory (e.g. a CPU tensor given
                to a device backend).
        """
        ...

    def verify_registration(self, geometry: KVGeometry) -> None:
        """After the transport registered ``geometry.regions()``: check the memory really is
        what this backend claims (e.g. device memory of ``geometry.dev_id`` rather than a silent
        host fallback). Implement it with ``verify_regions`` and a per-address check.

        Args:
            geometry: the described KV cache (``kv_tensors.describe_kv_caches``).

        Raises:
            BackendError: the memory type or any region is not this backend's memory.
        """
        ...


def verify_regions(
    backend: KVBackend,
    geometry: KVGeometry,
    check_address: Callable[[int], Any] | None = None,
    *,
    last_byte: bool = True,
) -> list[Any]:
    """The shared part of every ``verify_registration``.

    Args:
        backend: the backend whose memory ``geometry`` should be.
        geometry: the registered KV cache.
        check_address: the backend's check of one address: raises ``BackendError`` saying what
            the memory at that address is instead, or returns a value the backend wants to keep
            (e.g. which network device serves it). Called on the first and (``last_byte``) the
            last byte of every region, since a region is registered as one range and both ends
            must lie in the backend's memory. None: only the memory type is checked.
        last_byte: also check each region's last byte; False where the backend's check is
            documented only for an allocation's base address (Neuron).

    Returns:
        ``check_address``'s results, one or two per region, in ``geometry.regions()`` order.

    Raises:
        BackendError: ``geometry.mem_type`` is not ``backend.mem_type``, or ``check_address``
            raised (its message gains the region it was checking).
    """
    if geometry.mem_type != backend.mem_type:
        raise BackendError(f"{backend.name} backend got {geometry.mem_type} memory, "
                           f"expected {backend.mem_type}")
    results: list[Any] = []
    if check_address is None:
        return results
    for base, length in geometry.regions():
        for addr in ((base, base + length - 1) if last_byte else (base,)):
            try:
                results.append(check_address(addr))
            except BackendError as e:
                raise BackendError(f"{e} [KV region {base:#x}+{length}, tp_rank "
                                   f"{geometry.tp_rank}]") from None
    return results


#: alignment of a staging pool's base (slots are aligned relative to it)
STAGING_ALIGN = 4096


class HostBackend:
    """KV cache in host DRAM (vLLM's CPU build, tests, the demo). Always available."""

    name = "host"
    mem_type = "DRAM"
    nixl_backends = ("UCX",)
    nixl_progress_thread = False
    #: host KV blocks are copied whole as large regions already: no pool unless configured
    default_staging_bytes = 0
    #: a step's KV is in memory when vLLM's ``wait_for_save`` runs (the CPU forward is
    #: synchronous): a prefill completed in that step may be announced then
    kv_ready_at_save = True

    @classmethod
    def available(cls) -> bool:
        return True

    def prepare(self, colocated: bool = False) -> None:
        return None

    def device_id(self, tensor: Any) -> int:
        return 0

    def verify_registration(self, geometry: KVGeometry) -> None:
        verify_regions(self, geometry)  # any host address can be registered as DRAM

    def alloc_staging(self, nbytes: int, dev_id: int = 0) -> tuple[int, Any]:
        """``nbytes`` of host memory aligned to ``STAGING_ALIGN`` (a numpy buffer)."""
        import numpy as np

        if nbytes <= 0:
            raise BackendError(f"a staging pool needs a positive size, got {nbytes}")
        try:
            buf = np.empty(nbytes + STAGING_ALIGN, dtype=np.uint8)
        except MemoryError:
            raise BackendError(f"cannot allocate {nbytes} bytes of host staging memory") from None
        skip = -buf.ctypes.data % STAGING_ALIGN
        view = buf[skip: skip + nbytes]
        return int(view.ctypes.data), view


def _load(spec: str) -> type:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def select_backend(name: str | None = None) -> KVBackend:
    """The memory backend for this process.

    Args:
        name: a name in ``BACKENDS``; None or "" reads ``$KV_PUSH_BACKEND``, and when that is
            unset too, the first available backend in ``BACKENDS`` order is used.

    Returns:
        A new instance of the backend, built with its defaults.

    Raises:
        BackendError: the name is not in ``BACKENDS``, or the named backend is not available
            on this machine.
    """
    name = (name or os.environ.get(BACKEND_ENV, "")).strip().lower() or None
    if name is not None:
        if name not in BACKENDS:
            raise BackendError(
                f"{BACKEND_ENV}={name!r} is not a backend; choose one of {sorted(BACKENDS)}"
            )
        cls = _load(BACKENDS[name])
        if not cls.available():
            raise BackendError(
                f"{BACKEND_ENV}={name} was chosen but cannot run on this machine "
                f"({cls.__doc__.strip().splitlines()[0] if cls.__doc__ else cls.__name__})"
            )
        return cls()
    for candidate, spec in BACKENDS.items():
        try:
            cls = _load(spec)
        except ImportError:
            continue
        if cls.available():
            logger.info("kv_push: detected backend %s", candidate)
            return cls()
    return HostBackend()
