"""Describing the KV tensors vLLM hands the connector as a ``KVGeometry``.

``describe_kv_caches`` uses only duck-typed tensor attributes (``data_ptr()``, ``shape``,
``stride()``, ``element_size()``), so it works for torch tensors of any device and for test
stand-ins; from the memory backend it needs only ``mem_type`` and ``device_id``. When the caller
does not name the axes, ``guess_dims`` tells them from the shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from .geometry import GeometryError, KVGeometry, TokenOrder
from .geometry import local_heads as local_heads_of

if TYPE_CHECKING:
    from .backend import KVBackend

#: Dimension names: "2" the K/V axis, "B" blocks, "T" tokens in a block, "H" heads, "D" head size.
#: 4-D layouts have no K/V axis: each vector holds K and V together (vLLM's CPU backend keeps
#: ``(num_blocks, heads, block_size, 2 * head_size)``), so "D" there is ``2 * head_size``.
KNOWN_LAYOUTS = ("2BTHD", "2BHTD", "B2THD", "B2HTD", "BHTD", "BTHD")


def guess_dims(shape: Sequence[int], block_size: int, local_heads: int, head_size: int) -> str:
    """Name the axes of a 4-D or 5-D KV tensor from its shape (see ``KNOWN_LAYOUTS``).

    Raises:
        GeometryError: no known layout, or more than one, fits the shape.
    """
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
    """A geometry for per-layer KV tensors (one tensor per layer, all laid out alike).

    The physical token order (NHD or HND) is read from the strides, so a permuted view (vLLM's
    stride order for HND backends) is described correctly. A 4-D combined ``[K | V]`` cache
    (vLLM's CPU backend) is ``opaque`` unless ``opaque_combined`` is False: its kernels tile a
    block's interior per ISA, so only whole blocks can be copied.

    Args:
        tensors: one KV tensor per layer, in layer order (layers sharing a cache given once).
        backend: the memory backend: gives ``mem_type`` and ``device_id`` of the tensors.
        num_kv_heads, head_size, block_size, dtype: the model's KV shape (all TP ranks).
        tp_size, tp_rank: this worker's place in tensor parallelism.
        dims: the axes' names (see ``KNOWN_LAYOUTS``); None: ``guess_dims`` from the shape.
        opaque_combined: describe a combined ``[K | V]`` cache as opaque whole blocks.

    Returns:
        The validated geometry of this worker's KV cache.

    Raises:
        GeometryError: the tensors differ, are unmapped, or are not a dense NHD/HND layout that
            holds ``block_size`` tokens of this rank's heads.
        BackendError: from ``backend.device_id``, the tensors are not the backend's memory.
    """
    if not tensors:
        raise GeometryError("no KV cache tensors to describe")
    local_heads = local_heads_of(num_kv_heads, tp_size)
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
