"""Memory backends: the only accelerator-specific part of the distribution.

A backend knows how to describe and register one worker's KV memory; everything else (protocol,
rendezvous, mapping, transfers) lives once in ``common/``. A backend answers:

* ``mem_type`` -- the NIXL memory type of its KV memory ("DRAM" or "VRAM");
* ``available()`` -- can it run on this machine (used for detection);
* ``prepare()`` -- what must hold before the NIXL agent is created (environment, runtime
  initialisation); raise ``BackendError`` with a clear message when it cannot run here;
* ``device_id(tensor)`` -- the device id NIXL descriptors carry for a tensor of its KV cache;
* ``verify_registration(geometry)`` -- after registering, check that the memory really is what
  the backend claims (e.g. device memory rather than a silent host fallback);
* ``alloc_staging(nbytes, dev_id)`` -- (optional) memory for a staging pool of the staged
  transfer path, of the backend's ``mem_type`` on device ``dev_id``: returns ``(address,
  keepalive)``, the memory staying allocated while ``keepalive`` is referenced; raises
  ``BackendError`` when it cannot. ``default_staging_bytes`` is the pool size the config's ``-1``
  stands for (0: no pool unless configured). A backend without ``alloc_staging`` never stages.

Choose with ``KV_PUSH_BACKEND=host|cuda|neuron``; unset, it is detected (neuron, then cuda, then
host). ``describe_kv_caches`` turns the tensors vLLM hands the connector into a ``KVGeometry``
using only duck-typed tensor attributes (``data_ptr()``, ``shape``, ``stride()``,
``element_size()``), so it works for torch tensors of any device and for test stand-ins.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any, Protocol, Sequence

from .geometry import GeometryError, KVGeometry, TokenOrder

logger = logging.getLogger(__name__)

BACKEND_ENV = "KV_PUSH_BACKEND"
BACKENDS = {
    "host": "kv_push.common.backend:HostBackend",
    "cuda": "kv_push.gpu_push.backend:CudaBackend",
    "neuron": "kv_push.neuron_push.backend:NeuronBackend",
}
DETECT_ORDER = ("neuron", "cuda", "host")


class BackendError(RuntimeError):
    """The chosen backend cannot run here, or its memory is not what it claims."""


class KVBackend(Protocol):
    name: str
    mem_type: str
    nixl_backends: tuple[str, ...]  # the NIXL backends that can register this memory

    @classmethod
    def available(cls) -> bool: ...

    def prepare(self, colocated: bool = False) -> None: ...

    def device_id(self, tensor: Any) -> int: ...

    def verify_registration(self, geometry: KVGeometry) -> None: ...


#: alignment of a staging pool's base (slots are aligned relative to it)
STAGING_ALIGN = 4096


class HostBackend:
    """KV cache in host DRAM (vLLM's CPU build, tests, the demo). Always available."""

    name = "host"
    mem_type = "DRAM"
    nixl_backends = ("UCX",)
    #: host KV blocks are copied whole as large regions already: no pool unless configured
    default_staging_bytes = 0

    @classmethod
    def available(cls) -> bool:
        return True

    def prepare(self, colocated: bool = False) -> None:
        return None

    def device_id(self, tensor: Any) -> int:
        return 0

    def verify_registration(self, geometry: KVGeometry) -> None:
        if geometry.mem_type != "DRAM":
            raise BackendError(f"host backend got {geometry.mem_type} memory")

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
    """The backend named by ``name`` or ``$KV_PUSH_BACKEND``; detected when both are unset."""
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
    for candidate in DETECT_ORDER:
        try:
            cls = _load(BACKENDS[candidate])
        except ImportError:
            continue
        if cls.available():
            logger.info("kv_push: detected backend %s", candidate)
            return cls()
    return HostBackend()


# -- describing the tensors vLLM gives the connector -----------------------------------------

#: Dimension names: "2" the K/V axis, "B" blocks, "T" tokens in a block, "H" heads, "D" head size.
#: 4-D layouts have no K/V axis: each vector holds K and V together (vLLM's CPU backend keeps
#: ``(num_blocks, heads, block_size, 2 * head_size)``), so "D" there is ``2 * head_size``.
KNOWN_LAYOUTS = ("2BTHD", "2BHTD", "B2THD", "B2HTD", "BHTD", "BTHD")


def guess_dims(shape: Sequence[int], block_size: int, local_heads: int, head_size: int) -> str:
    """Name the axes of a 5-D KV tensor from its shape; raise if ambiguous or unknown."""
    if len(shape) not in (4, 5):
        raise GeometryError(f"expected a 4-D or 5-D KV cache tensor, got shape {tuple(shape)}")
    matches = []
    for dims in KNOWN_LAYOUTS:
        if len(dims) != len(shape):
            continue
        want = {"2": 2, "T": block_size, "H": local_heads,
                "D": head_size if len(shape) == 5 else 2 * head_size}
        if all(dims[i] == "B" or shape[i] == want[dims[i]] for i in range(len(shape))):
            matches.append(dims)
    if len(matches) != 1:
        raise GeometryError(
            f"cannot tell the axes of KV tensor shape {tuple(shape)} (block_size={block_size}, "
            f"heads={local_heads}, head_size={head_size}): candidates {matches}; pass dims"
        )
    return matches[0]


def describe_kv_caches(
    tensors: Sequence[Any],
    *,
    backend: KVBackend,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    tp_size: int,
    tp_rank: int,
    dtype: str,
    dims: str | None = None,
    opaque_combined: bool = True,
) -> KVGeometry:
    """A geometry for per-layer KV tensors (one 5-D tensor per layer, all laid out alike).

    The physical token order (NHD or HND) is read from the strides, so a permuted view (vLLM's
    stride order for HND backends) is described correctly. A 4-D combined ``[K | V]`` cache
    (vLLM's CPU backend) is ``opaque`` unless ``opaque_combined`` is False: its kernels tile a
    block's interior per ISA, so only whole blocks can be copied.
    """
    if not tensors:
        raise GeometryError("no KV cache tensors to describe")
    local_heads = max(1, num_kv_heads // tp_size)
    first = tensors[0]
    shape = tuple(int(s) for s in first.shape)
    dims = dims or guess_dims(shape, block_size, local_heads, head_size)
    if sorted(dims) not in (sorted("2BTHD"), sorted("BTHD")) or len(dims) != len(shape):
        raise GeometryError(f"dims {dims!r} must name the axes (2,) B, T, H and D once each")
    kv_parts = 2 if "2" in dims else 1
    if kv_parts == 1:
        head_size = int(shape[dims.index("D")])  # the combined [K | V] vector
    axis = {d: dims.index(d) for d in dims}
    esize = int(first.element_size())
    k_bases, v_bases = [], []
    ref = None
    for t in tensors:
        tshape = tuple(int(s) for s in t.shape)
        strides = tuple(int(s) for s in t.stride())
        if tshape != shape:
            raise GeometryError(f"KV tensors differ in shape: {shape} and {tshape}")
        if ref is None:
            ref = strides
        elif strides != ref:
            raise GeometryError(f"KV tensors differ in strides: {ref} and {strides}")
        base = int(t.data_ptr())
        if base == 0:
            raise GeometryError(
                "a KV tensor has data_ptr() == 0: its memory is not mapped into this process "
                "(on Neuron, set NEURON_RT_MAP_HBM=1 before the first device allocation)"
            )
        k_bases.append(base)
        if kv_parts == 2:
            v_bases.append(base + strides[axis["2"]] * esize)
    assert ref is not None
    s = {d: ref[axis[d]] for d in dims}
    if s["D"] != 1:
        raise GeometryError(f"head_size axis must be contiguous, stride is {s['D']}")
    order: TokenOrder
    if kv_parts == 1 and opaque_combined:
        order = "opaque"
    elif s["H"] == head_size and s["T"] == local_heads * head_size:
        order = "NHD"
    elif s["T"] == head_size and s["H"] == shape[axis["T"]] * head_size:
        order = "HND"
    else:
        raise GeometryError(f"block is not a dense NHD or HND tile (strides {ref}, dims {dims})")
    if shape[axis["T"]] != block_size or shape[axis["H"]] != local_heads:
        raise GeometryError(
            f"tensor shape {shape} ({dims}) does not hold block_size={block_size} and "
            f"{local_heads} local heads"
        )
    geometry = KVGeometry(
        num_layers=len(tensors),
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype_bytes=esize,
        dtype=dtype,
        block_size=block_size,
        token_order=order,
        tp_size=tp_size,
        tp_rank=tp_rank,
        num_blocks=shape[axis["B"]],
        block_stride=s["B"] * esize,
        k_bases=tuple(k_bases),
        v_bases=tuple(v_bases),
        mem_type=backend.mem_type,
        dev_id=backend.device_id(first),
        kv_parts=kv_parts,
    )
    geometry.validate()
    return geometry
