"""CUDA backend: KV in GPU memory, registered as NIXL VRAM (UCX by default, LIBFABRIC on EFA).

With UCX the GPU paths are the cuda_ipc / cuda_copy transports: measured here on an H200,
``UCX_TLS=^cuda_ipc`` took VRAM-to-VRAM WRITEs from 1,373 GB/s to 0.48 GB/s, so ``prepare`` warns
when ``UCX_TLS`` leaves them out. ``verify_registration`` asks the CUDA driver
(``cuPointerGetAttribute``, the check NIXL's own backends make) that every KV region is device
memory of the right GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

from kv_push.common.backend import BackendError, verify_regions
from kv_push.common.geometry import KVGeometry

logger = logging.getLogger(__name__)

#: the NIXL backends that can register CUDA memory
CUDA_NIXL_BACKENDS = ("UCX", "LIBFABRIC")
CUDA_UCX_TLS = ("cuda_ipc", "cuda_copy")


def ucx_tls_missing_cuda(value: str | None) -> list[str]:
    """The CUDA transports a ``UCX_TLS`` value leaves out ("cuda" names them all)."""
    if not value or not value.strip():
        return []
    names = {n.strip().lower() for n in value.strip().lstrip("^").split(",") if n.strip()}
    if value.strip().startswith("^"):
        return [t for t in CUDA_UCX_TLS if t in names or "cuda" in names]
    if "all" in names or "cuda" in names:
        return []
    return [t for t in CUDA_UCX_TLS if t not in names]


class CudaDriver:
    """Pointer queries through the CUDA driver API (libcuda.so.1)."""

    MEMORY_TYPE, DEVICE_ORDINAL = 2, 9  # CUpointer_attribute
    MEMORYTYPE_DEVICE = 2  # CUmemorytype

    def __init__(self, lib_name: str = "libcuda.so.1"):
        self.lib_name = lib_name
        self._lib: Any = None

    def _load(self) -> Any:
        if self._lib is None:
            lib = ctypes.CDLL(self.lib_name)
            lib.cuInit.argtypes = [ctypes.c_uint]
            lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
            lib.cuInit(0)  # idempotent; torch has normally done it
            self._lib = lib
        return self._lib

    def pointer_device(self, addr: int) -> int | None:
        """The GPU ordinal owning device memory at ``addr``; None if it is not device memory."""
        lib = self._load()
        kind, ordinal = ctypes.c_uint(0), ctypes.c_int(-1)
        if lib.cuPointerGetAttribute(ctypes.byref(kind), self.MEMORY_TYPE, addr) != 0:
            return None  # e.g. CUDA_ERROR_INVALID_VALUE for memory CUDA does not know
        if kind.value != self.MEMORYTYPE_DEVICE:
            return None
        if lib.cuPointerGetAttribute(ctypes.byref(ordinal), self.DEVICE_ORDINAL, addr) != 0:
            return None
        return ordinal.value

    def allocation_range(self, addr: int) -> tuple[int, int] | None:
        """(base, size) of the CUDA allocation holding ``addr`` (cuMemGetAddressRange)."""
        lib = self._load()
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        fn = lib.cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
        if fn(ctypes.byref(base), ctypes.byref(size), addr) != 0:
            return None
        return base.value, size.value


class CudaBackend:
    """KV cache in CUDA device memory (needs torch with a usable CUDA device).

    ``nixl_backends``: from ``CUDA_NIXL_BACKENDS``, preferred first. ``driver``: answers
    ``pointer_device`` and ``allocation_range`` as ``CudaDriver`` does (tests pass a stand-in).
    """

    name = "cuda"
    mem_type = "VRAM"
    #: staging pool per worker when the config says -1 (see docs/gpu.md for how it interacts
    #: with --gpu-memory-utilization)
    default_staging_bytes = 2 << 30

    nixl_progress_thread = False

    def __init__(self, nixl_backends: tuple[str, ...] = CUDA_NIXL_BACKENDS, driver: Any = None):
        if not nixl_backends or any(b not in CUDA_NIXL_BACKENDS for b in nixl_backends):
            raise BackendError(f"cuda backend: nixl_backends must be from "
                               f"{CUDA_NIXL_BACKENDS}, got {nixl_backends}")
        #: NIXL backends that can register CUDA memory, preferred first
        self.nixl_backends = tuple(nixl_backends)
        self.driver = driver if driver is not None else CudaDriver()

    @classmethod
    def available(cls) -> bool:
        try:
            import torch

            return bool(torch.cuda.is_available())
        except Exception:  # no torch, or a CPU build: not available, never an error here
            return False

    def prepare(self, colocated: bool = False) -> None:
        if not self.available():
            raise BackendError(
                "cuda backend: CUDA is not usable here (torch.cuda.is_available() is False: no "
                "GPU, no driver, or a CPU build of torch)"
            )
        missing = ucx_tls_missing_cuda(os.environ.get("UCX_TLS"))
        if "UCX" in self.nixl_backends and missing:
            logger.warning(
                "kv_push cuda: UCX_TLS=%s leaves out %s: GPU-to-GPU transfers fall back to slow "
                "paths (measured on an H200: 0.48 GB/s without cuda_ipc, ~1,400 GB/s with it)",
                os.environ.get("UCX_TLS"), ", ".join(missing),
            )

    def device_id(self, tensor: Any) -> int:
        device = tensor.device
        if device.type != "cuda":
            raise BackendError(f"cuda backend got a tensor on {device}, not on a CUDA device")
        if device.index is not None:
            return int(device.index)
        import torch

        return int(torch.cuda.current_device())

    def alloc_staging(self, nbytes: int, dev_id: int) -> tuple[int, Any]:
        """``nbytes`` of device memory on GPU ``dev_id`` (one ``torch.empty`` allocation, so it
        is one CUDA allocation as UCX cuda_ipc needs). Raises ``BackendError`` when the GPU
        cannot hold it (nothing is taken from vLLM's KV cache: that is allocated already)."""
        import torch

        if nbytes <= 0:
            raise BackendError(f"a staging pool needs a positive size, got {nbytes}")
        try:
            t = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", dev_id))
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError is a RuntimeError
            raise BackendError(f"cannot allocate a {nbytes / 2**30:.2f} GiB staging pool on GPU "
                               f"{dev_id}: {e}") from None
        addr = int(t.data_ptr())
        span = self.driver.allocation_range(addr)
        if span is not None and addr + nbytes > span[0] + span[1]:
            raise BackendError(f"staging pool {addr:#x}+{nbytes} crosses CUDA allocations")
        return addr, t

    def verify_registration(self, geometry: KVGeometry) -> None:
        verify_regions(self, geometry, lambda addr: self._check_device_address(addr, geometry))
        # UCX cuda_ipc maps the allocation of a region's first byte: a region must not cross
        # allocations (two adjacent per-layer tensors are two allocations)
        for base, length in geometry.regions():
            span = self.driver.allocation_range(base)
            if span is not None and base + length > span[0] + span[1]:
                raise BackendError(
                    f"KV region {base:#x}+{length} crosses CUDA allocations (the one at its "
                    f"start ends at {span[0] + span[1]:#x}); it cannot be registered as one")

    def _check_device_address(self, addr: int, geometry: KVGeometry) -> None:
        ordinal = self.driver.pointer_device(addr)
        if ordinal is None:
            raise BackendError(
                f"KV address {addr:#x} is not CUDA device memory (cuPointerGetAttribute): it "
                "cannot be registered as VRAM")
        if ordinal != geometry.dev_id:
            raise BackendError(f"KV address {addr:#x} is on GPU {ordinal}, but the geometry says "
                               f"dev_id {geometry.dev_id}")
