"""Tests for the memory backends: selection, the Neuron start-up traps, and describing KV tensors.

Runs anywhere: the Neuron backend is driven through ``neuron_standin.FakeNeuronRuntime`` (real
host memory behind fake device tensors) and CUDA-like layouts are real torch CPU tensors, whose
every (layer, K/V, block, token, head) vector address is compared with what the geometry says.
Tests marked ``neuron`` / ``cuda`` need the hardware, skip without it, and on it allocate device
tensors, describe them, register them with a real NIXL agent and verify the registration.
"""

from __future__ import annotations

import importlib
import logging
import os

import numpy as np
import pytest
import torch

from kv_push.common import geometry as G
from kv_push.common.backend import (
    BACKEND_ENV,
    BACKENDS,
    NIXL_BACKENDS,
    BackendError,
    HostBackend,
    KVBackend,
    select_backend,
    verify_regions,
)
from kv_push.common.config import PushConfig
from kv_push.common.geometry import GeometryError, KVGeometry
from kv_push.common.kv_tensors import describe_kv_caches
from kv_push.gpu_push.backend import CudaBackend, ucx_tls_missing_cuda
from kv_push.neuron_push.backend import NeuronBackend
from neuron_standin import FakeNeuronRuntime

GOOD_ENV = {"NEURON_RT_MAP_HBM": "1", "FI_EFA_USE_DEVICE_RDMA": "1"}


def vector_addr(g: KVGeometry, layer: int, kv: int, block: int, token: int, head: int) -> int:
    """Address of one (token, local head) vector as the geometry's docstring defines it."""
    base = (g.k_bases if kv == 0 else g.v_bases)[layer] + block * g.block_stride
    index = token * g.local_heads + head if g.token_order == "NHD" else head * g.block_size + token
    return base + index * g.vec_bytes


# -- the seam and the table -----------------------------------------------------------------


def test_every_backend_in_the_table_loads_and_honours_the_seam():
    members = [n for n in vars(KVBackend) if not n.startswith("_")]
    members += list(KVBackend.__annotations__)
    for name, spec in BACKENDS.items():
        module, _, attr = spec.partition(":")
        cls = getattr(__import__(module, fromlist=[attr]), attr)
        assert cls.name == name
        assert cls.mem_type in ("DRAM", "VRAM")
        assert isinstance(cls.available(), bool)
        assert PushConfig(backend=name).validate().backend == name  # the config knows it
        for m in members:
            assert hasattr(cls, m) or m == "nixl_backends", f"{cls.__name__} lacks {m}"
    # instance attribute for cuda (configurable), class attribute for the others
    for backend in (HostBackend(), CudaBackend(), NeuronBackend(runtime=ready_runtime())):
        assert backend.nixl_backends and set(backend.nixl_backends) <= set(NIXL_BACKENDS)
    assert list(BACKENDS)[-1] == "host"  # detection falls back to host, always available


def test_every_seam_method_is_documented():
    import inspect

    for name in ("available", "prepare", "device_id", "verify_registration"):
        doc = inspect.getdoc(getattr(KVBackend, name)) or ""
        params = [p for p in inspect.signature(getattr(KVBackend, name)).parameters
                  if p not in ("self", "cls")]
        assert all(f"{p}:" in doc for p in params), name
        assert "Returns:" in doc or "Raises:" in doc, name


class Probe:
    """A per-address check: memory is the given ranges, named by what serves them."""

    def __init__(self, ranges):
        self.ranges, self.asked = ranges, []

    def __call__(self, addr):
        self.asked.append(addr)
        for base, n, what in self.ranges:
            if base <= addr < base + n:
                return what
        raise BackendError(f"KV address {addr:#x} is not device memory")


def _vram(bases=(1 << 40, (1 << 40) + 4096), num_blocks=2, mem_type="VRAM"):
    return G.kv_split(layer_bases=[bases], num_kv_heads=1, head_size=8, dtype_bytes=2,
                      dtype="bfloat16", block_size=4, num_blocks=num_blocks, mem_type=mem_type)


def test_verify_regions_checks_both_ends_of_every_region():
    backend = NeuronBackend(runtime=ready_runtime())
    g = _vram()
    (k, klen), (v, vlen) = g.regions()
    probe = Probe([(k, klen, "rail-k"), (v, vlen, "rail-v")])
    assert verify_regions(backend, g, probe) == ["rail-k", "rail-k", "rail-v", "rail-v"]
    assert probe.asked == [k, k + klen - 1, v, v + vlen - 1]
    short = Probe([(k, klen, "rail-k"), (v, vlen - 1, "rail-v")])  # V's last byte is not HBM
    with pytest.raises(BackendError, match=rf"{v + vlen - 1:#x} is not device memory "
                                           rf"\[KV region {v:#x}\+{vlen}, tp_rank 0\]"):
        verify_regions(backend, g, short)


def test_verify_regions_checks_the_memory_type_first():
    probe = Probe([])
    with pytest.raises(BackendError, match="neuron backend got DRAM memory, expected VRAM"):
        verify_regions(NeuronBackend(runtime=ready_runtime()), _vram(mem_type="DRAM"), probe)
    assert probe.asked == []
    with pytest.raises(BackendError, match="host backend got VRAM memory, expected DRAM"):
        HostBackend().verify_registration(_vram())
    HostBackend().verify_registration(_vram(mem_type="DRAM"))


# -- selection ------------------------------------------------------------------------------


def test_select_neuron_without_hardware_is_a_clear_error(monkeypatch):
    if NeuronBackend.available():
        pytest.skip("this machine has Neuron hardware")
    monkeypatch.setenv(BACKEND_ENV, "neuron")
    with pytest.raises(BackendError, match="neuron was chosen but cannot run"):
        select_backend()


def test_select_cuda_without_gpu_is_a_clear_error(monkeypatch):
    if CudaBackend.available():
        pytest.skip("this machine has a CUDA GPU")
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(BackendError, match="cuda was chosen but cannot run"):
        select_backend()


def test_select_unknown_backend_names_the_choices(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "bogus")
    with pytest.raises(BackendError, match=r"'bogus' is not a backend.*cuda.*host.*neuron"):
        select_backend()


def test_unset_detects_host_here(monkeypatch):
    if NeuronBackend.available() or CudaBackend.available():
        pytest.skip("this machine has an accelerator")
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert isinstance(select_backend(), HostBackend)


def test_detection_prefers_neuron_then_cuda(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(CudaBackend, "available", classmethod(lambda cls: True))
    assert isinstance(select_backend(), CudaBackend)
    monkeypatch.setattr(NeuronBackend, "available", classmethod(lambda cls: True))
    assert isinstance(select_backend(), NeuronBackend)


# -- CUDA backend, without a GPU ------------------------------------------------------------


def test_cuda_available_does_not_raise_on_cpu_torch():
    assert CudaBackend.available() is torch.cuda.is_available()


def test_cuda_prepare_without_gpu_is_a_clear_error():
    if CudaBackend.available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(BackendError, match="CUDA is not usable here"):
        CudaBackend().prepare()


def test_cuda_nixl_backends_default_ucx_libfabric_selectable():
    assert CudaBackend().nixl_backends == ("UCX", "LIBFABRIC")  # UCX preferred
    assert CudaBackend(nixl_backends=("LIBFABRIC",)).nixl_backends == ("LIBFABRIC",)
    with pytest.raises(BackendError, match="nixl_backends"):
        CudaBackend(nixl_backends=("GDS",))


@pytest.mark.parametrize(
    "value, missing",
    [
        (None, []),
        ("", []),
        ("all", []),
        ("rc,cuda", []),
        ("rc,cuda_copy,cuda_ipc", []),
        ("^cuda_ipc", ["cuda_ipc"]),
        ("^tcp,cuda_copy", ["cuda_copy"]),
        ("^cuda", ["cuda_ipc", "cuda_copy"]),
        ("tcp,sm", ["cuda_ipc", "cuda_copy"]),
        ("rc,cuda_copy", ["cuda_ipc"]),
    ],
)
def test_ucx_tls_cuda_transports(value, missing):
    assert ucx_tls_missing_cuda(value) == missing


def test_cuda_prepare_warns_when_ucx_tls_excludes_cuda_ipc(monkeypatch, caplog):
    monkeypatch.setattr(CudaBackend, "available", classmethod(lambda cls: True))
    monkeypatch.setenv("UCX_TLS", "^cuda_ipc")
    with caplog.at_level(logging.WARNING):
        CudaBackend().prepare()
    assert "leaves out cuda_ipc" in caplog.text
    caplog.clear()
    monkeypatch.setenv("UCX_TLS", "rc,cuda")
    with caplog.at_level(logging.WARNING):
        CudaBackend().prepare()
        CudaBackend(nixl_backends=("LIBFABRIC",)).prepare()
    assert caplog.text == ""


class FakeCudaDriver:
    """Device memory = the given (address, bytes, ordinal) ranges."""

    def __init__(self, ranges):
        self.ranges = ranges

    def pointer_device(self, addr):
        for base, n, ordinal in self.ranges:
            if base <= addr < base + n:
                return ordinal
        return None

    def allocation_range(self, addr):
        for base, n, _ in self.ranges:
            if base <= addr < base + n:
                return base, n
        return None


def test_cuda_verify_registration_rejects_host_and_wrong_gpu():
    g = G.kv_split(layer_bases=[(1 << 40, (1 << 40) + 4096)], num_kv_heads=2, head_size=8,
                   dtype_bytes=2, dtype="bfloat16", block_size=16, num_blocks=8,
                   mem_type="VRAM", dev_id=1)
    span = 8 * g.block_bytes + 4096
    CudaBackend(driver=FakeCudaDriver([(1 << 40, span, 1)])).verify_registration(g)
    with pytest.raises(BackendError, match="not CUDA device memory"):
        CudaBackend(driver=FakeCudaDriver([])).verify_registration(g)
    with pytest.raises(BackendError, match="not CUDA device memory"):  # the end is outside
        CudaBackend(driver=FakeCudaDriver([(1 << 40, 100, 1)])).verify_registration(g)
    with pytest.raises(BackendError, match="on GPU 0"):
        CudaBackend(driver=FakeCudaDriver([(1 << 40, span, 0)])).verify_registration(g)
    with pytest.raises(BackendError, match="expected VRAM"):
        CudaBackend(driver=FakeCudaDriver([])).verify_registration(
            G.kv_split(layer_bases=[(4096, 8192)], num_kv_heads=1, head_size=8, dtype_bytes=2,
                       dtype="bfloat16", block_size=4, num_blocks=2)
        )


def test_cuda_verify_registration_rejects_a_region_crossing_allocations():
    g = G.kv_split(layer_bases=[(1 << 40, (1 << 40) + 4096)], num_kv_heads=2, head_size=8,
                   dtype_bytes=2, dtype="bfloat16", block_size=16, num_blocks=8,
                   mem_type="VRAM", dev_id=0)
    (k, klen), (v, vlen) = g.regions()
    # both ends are device memory of GPU 0, but K's region runs from one allocation into the next
    two = FakeCudaDriver([(k, klen // 2, 0), (k + klen // 2, v + vlen - k - klen // 2, 0)])
    with pytest.raises(BackendError, match="crosses CUDA allocations"):
        CudaBackend(driver=two).verify_registration(g)


def test_cuda_device_id_rejects_cpu_tensors():
    with pytest.raises(BackendError, match="not on a CUDA device"):
        CudaBackend().device_id(torch.zeros(1))


# -- Neuron backend against the stand-in ----------------------------------------------------


def ready_runtime(**env) -> FakeNeuronRuntime:
    return FakeNeuronRuntime({**GOOD_ENV, **env}, initialised=True)


def test_neuron_nixl_backend_is_libfabric():
    assert NeuronBackend.nixl_backends == ("LIBFABRIC",)
    assert NeuronBackend(runtime=ready_runtime()).mem_type == "VRAM"


def test_neuron_available_false_without_torch_neuronx_or_device():
    if os.path.exists("/dev/neuron0"):
        pytest.skip("this machine has a Neuron device")
    assert NeuronBackend.available() is False


@pytest.mark.parametrize("value", [None, "", "0", "false", "no"])
def test_neuron_prepare_requires_map_hbm(value):
    env = {**GOOD_ENV, "NEURON_RT_MAP_HBM": value}
    if value is None:
        del env["NEURON_RT_MAP_HBM"]
    rt = FakeNeuronRuntime(env, initialised=True)
    with pytest.raises(BackendError, match="set NEURON_RT_MAP_HBM=1 before"):
        NeuronBackend(runtime=rt).prepare()


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "2"])
def test_neuron_prepare_accepts_map_hbm(value):
    rt = FakeNeuronRuntime({**GOOD_ENV, "NEURON_RT_MAP_HBM": value}, initialised=True)
    NeuronBackend(runtime=rt).prepare()


def test_neuron_prepare_requires_libnrt_by_name():
    rt = FakeNeuronRuntime(GOOD_ENV, lib_loadable=False, initialised=True)
    with pytest.raises(BackendError, match=r"cannot load libnrt\.so\.1 by name"):
        NeuronBackend(runtime=rt).prepare()


def test_real_runtime_reports_libnrt_missing_here():
    from kv_push.neuron_push.backend import NeuronRuntime

    rt = NeuronRuntime()
    if rt.lib_loadable():
        pytest.skip("libnrt.so.1 is installed here")
    rt.env = GOOD_ENV.get  # the real runtime, with the NEURON_RT_MAP_HBM check satisfied
    with pytest.raises(BackendError, match=r"cannot load libnrt\.so\.1 by name"):
        NeuronBackend(runtime=rt).prepare()


def test_neuron_prepare_requires_initialised_runtime_before_the_agent():
    rt = FakeNeuronRuntime(GOOD_ENV, initialised=False)
    backend = NeuronBackend(runtime=rt)
    with pytest.raises(BackendError, match="not initialised.*NIXL agent must be created after"):
        backend.prepare()
    rt.empty((2, 4, 2, 8, 16))  # the first device allocation initialises the runtime
    assert rt.events[0] == "nrt_init" and rt.events[1].startswith("alloc:")
    backend.prepare()


def test_neuron_prepare_warns_when_initialisation_cannot_be_told(caplog):
    rt = FakeNeuronRuntime(GOOD_ENV, initialised=None)
    with caplog.at_level(logging.WARNING):
        NeuronBackend(runtime=rt).prepare()
    assert "could not tell whether the Neuron runtime is initialised" in caplog.text


@pytest.mark.parametrize("value", [None, "1", "2"])  # libfabric reads "true" as 0 (an int)
def test_neuron_colocated_requires_shm_transfer_off(value):
    env = dict(GOOD_ENV) if value is None else {**GOOD_ENV, "FI_EFA_ENABLE_SHM_TRANSFER": value}
    rt = FakeNeuronRuntime(env, initialised=True)
    with pytest.raises(BackendError, match="FI_EFA_ENABLE_SHM_TRANSFER"):
        NeuronBackend(runtime=rt).prepare(colocated=True)
    NeuronBackend(runtime=rt).prepare(colocated=False)  # separate hosts: shm is not in the path


def test_neuron_colocated_with_shm_transfer_off_logs_the_rail_note(caplog):
    rt = ready_runtime(FI_EFA_ENABLE_SHM_TRANSFER="0")
    with caplog.at_level(logging.INFO):
        NeuronBackend(runtime=rt).prepare(colocated=True)
    assert "LIBFABRIC" in caplog.text and "EFA device" in caplog.text and "25 GB/s" in caplog.text


def describe_neuron(tensors, rt, *, heads=4, tp_size=1, tp_rank=0, block_size=8, head_size=16):
    return describe_kv_caches(
        tensors, backend=NeuronBackend(runtime=rt), num_kv_heads=heads, head_size=head_size,
        block_size=block_size, tp_size=tp_size, tp_rank=tp_rank, dtype="bfloat16",
    )


def test_unmapped_hbm_gives_data_ptr_zero_and_a_clear_error():
    rt = FakeNeuronRuntime({}, initialised=False)  # NEURON_RT_MAP_HBM unset at allocation
    t = rt.empty((2, 6, 4, 8, 16))
    assert t.data_ptr() == 0
    with pytest.raises(GeometryError, match="NEURON_RT_MAP_HBM=1"):
        describe_neuron([t], rt)


def test_describe_neuron_layout_is_hnd_kv_split():
    rt = ready_runtime()
    nb, h, bs, d = 6, 2, 8, 16  # 4 KV heads over TP 2 -> 2 local heads
    layers = [rt.empty((2, nb, h, bs, d), device_index=1) for _ in range(3)]
    g = describe_neuron(layers, rt, heads=4, tp_size=2, tp_rank=1, block_size=bs, head_size=d)
    es = 2
    assert g.token_order == "HND" and g.mem_type == "VRAM" and g.dev_id == 1
    assert g.num_blocks == nb and g.local_heads == h and g.head_range == (2, 4)
    assert g.block_stride == g.block_bytes == h * bs * d * es  # K and V are separate regions
    assert g.k_bases == tuple(t.data_ptr() for t in layers)
    assert g.v_bases == tuple(t.data_ptr() + nb * h * bs * d * es for t in layers)
    assert g == G.kv_split(
        layer_bases=[(t.data_ptr(), t.data_ptr() + nb * h * bs * d * es) for t in layers],
        num_kv_heads=4, head_size=d, dtype_bytes=es, dtype="bfloat16", block_size=bs,
        num_blocks=nb, tp_size=2, tp_rank=1, token_order="HND", mem_type="VRAM", dev_id=1,
    )
    # every vector sits where the geometry says: write a distinct value into each and read back
    for layer, t in enumerate(layers):
        arr = t.numpy()
        arr[...] = np.arange(arr.size, dtype=np.float16).reshape(arr.shape) + layer
        for kv, b, tok, hd in [(0, 0, 0, 0), (1, 5, 7, 1), (0, 3, 2, 1), (1, 0, 4, 0)]:
            want = arr[kv, b, hd, tok]
            addr = vector_addr(g, layer, kv, b, tok, hd)
            offset = addr - t.data_ptr()
            got = np.frombuffer(t._buf.data, dtype=np.float16, count=d, offset=offset)
            np.testing.assert_array_equal(got, arr[kv, b, hd, tok, :])
            assert got[0] == want[0]


def test_neuron_verify_registration_accepts_hbm_and_names_the_rail(caplog):
    rt = ready_runtime()
    layers = [rt.empty((2, 6, 4, 8, 16), device_index=1) for _ in range(2)]
    g = describe_neuron(layers, rt)
    with caplog.at_level(logging.INFO):
        NeuronBackend(runtime=rt).verify_registration(g)
    assert "EFA 0000:20:1c.0" in caplog.text


def test_neuron_verify_registration_rejects_host_memory_presented_as_hbm():
    rt = ready_runtime()
    fallback = [rt.host_tensor((2, 6, 4, 8, 16)) for _ in range(2)]  # a silent host fallback
    g = describe_neuron(fallback, rt)
    assert g.mem_type == "VRAM"  # the geometry believes it
    with pytest.raises(BackendError, match="is not Neuron HBM"):
        NeuronBackend(runtime=rt).verify_registration(g)


def test_neuron_verify_registration_probes_only_region_bases():
    # nrt_get_attached_efa_bdf is documented for an allocation's address; NIXL's LIBFABRIC
    # backend passes each registered region's base. No source covers a region's last byte.
    rt = ready_runtime()
    layers = [rt.empty((2, 6, 4, 8, 16)) for _ in range(2)]
    g = describe_neuron(layers, rt)
    NeuronBackend(runtime=rt).verify_registration(g)
    assert rt.probed == [base for base, _ in g.regions()]


def test_neuron_verify_registration_rejects_dram_geometry():
    rt = ready_runtime()
    g = G.kv_split(layer_bases=[(4096, 8192)], num_kv_heads=1, head_size=8, dtype_bytes=2,
                   dtype="bfloat16", block_size=4, num_blocks=2)
    with pytest.raises(BackendError, match="got DRAM memory, expected VRAM"):
        NeuronBackend(runtime=rt).verify_registration(g)


def test_neuron_device_id_rejects_non_neuron_tensors():
    with pytest.raises(BackendError, match="not on a Neuron device"):
        NeuronBackend().device_id(torch.zeros(1))


# -- describing vLLM-CUDA-like layouts with real torch tensors ------------------------------

NB, BS, H, D = 5, 4, 3, 8  # all different from each other and from 2, so the axes are unambiguous


def describe_host(tensors, *, heads=H, tp_size=1, tp_rank=0):
    return describe_kv_caches(
        tensors, backend=HostBackend(), num_kv_heads=heads * tp_size, head_size=D,
        block_size=BS, tp_size=tp_size, tp_rank=tp_rank, dtype="float16",
    )


def check_every_vector(g: KVGeometry, layers, dims: str):
    """Each (layer, kv, block, token, head) element's real address equals the geometry's."""
    for layer, t in enumerate(layers):
        for kv in range(2):
            for b in range(NB):
                for tok in range(BS):
                    for hd in range(H):
                        idx = {"2": kv, "B": b, "T": tok, "H": hd}
                        elem = t[tuple(idx[c] for c in dims if c != "D")]
                        assert elem.data_ptr() == vector_addr(g, layer, kv, b, tok, hd)


def test_describe_kv_first_nhd():
    layers = [torch.zeros(2, NB, BS, H, D, dtype=torch.float16) for _ in range(2)]
    g = describe_host(layers)
    es = 2
    assert g.token_order == "NHD" and g.mem_type == "DRAM" and g.dev_id == 0
    assert g.block_stride == BS * H * D * es
    assert g.k_bases == tuple(t.data_ptr() for t in layers)
    assert g.v_bases == tuple(t.data_ptr() + NB * BS * H * D * es for t in layers)
    check_every_vector(g, layers, "2BTHD")


def test_describe_blocks_first_nhd():
    layers = [torch.zeros(NB, 2, BS, H, D, dtype=torch.float16) for _ in range(2)]
    g = describe_host(layers)
    es = 2
    assert g.token_order == "NHD"
    assert g.block_stride == 2 * BS * H * D * es  # K then V inside each block
    assert g.v_bases == tuple(t.data_ptr() + BS * H * D * es for t in layers)
    assert g == G.blocks_first(
        layer_bases=[t.data_ptr() for t in layers], num_kv_heads=H, head_size=D, dtype_bytes=es,
        dtype="float16", block_size=BS, num_blocks=NB,
    )
    check_every_vector(g, layers, "B2THD")


def test_describe_permuted_hnd_view():
    # physical (NB, 2, H, BS, D) as vLLM allocates for an HND stride order, viewed as
    # (NB, 2, BS, H, D): the logical shape is blocks-first NHD, the strides say HND
    physical = [torch.zeros(NB, 2, H, BS, D, dtype=torch.float16) for _ in range(2)]
    layers = [p.permute(0, 1, 3, 2, 4) for p in physical]
    assert layers[0].shape == (NB, 2, BS, H, D) and not layers[0].is_contiguous()
    g = describe_host(layers)
    es = 2
    assert g.token_order == "HND"
    assert g.block_stride == 2 * H * BS * D * es
    assert g.k_bases == tuple(p.data_ptr() for p in physical)
    assert g.v_bases == tuple(p.data_ptr() + H * BS * D * es for p in physical)
    check_every_vector(g, layers, "B2THD")


def test_describe_neuron_layout_with_torch_and_tp_slice():
    # the Neuron shape on CPU torch: (2, NB, H, BS, D), 6 KV heads over TP 2 -> 3 local heads
    layers = [torch.zeros(2, NB, H, BS, D, dtype=torch.float16) for _ in range(3)]
    g = describe_host(layers, tp_size=2, tp_rank=1)
    assert g.token_order == "HND" and g.local_heads == H and g.head_range == (3, 6)
    assert g.block_stride == g.block_bytes
    check_every_vector(g, layers, "2BHTD")


def test_describe_rejects_layers_that_differ():
    with pytest.raises(GeometryError, match="differ in strides"):
        describe_host([torch.zeros(NB, 2, BS, H, D, dtype=torch.float16),
                       torch.zeros(NB, 2, H, BS, D, dtype=torch.float16).permute(0, 1, 3, 2, 4)])


# -- hardware -------------------------------------------------------------------------------


def _nixl_agent(name: str, backends):
    nixl_api = pytest.importorskip("nixl._api")
    return nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(backends=list(backends)))


def neuron_hardware_or_skip() -> str:
    """Import the torch plugin this Neuron environment has, or skip: torch-neuronx, or the
    libtorch_neuronx_lite that Neuron SDK 2.32's vllm-neuron 0.24 environment has instead."""
    from kv_push.neuron_push.backend import NeuronRuntime

    plugin = NeuronRuntime.torch_plugin()
    if plugin is None or not os.path.exists("/dev/neuron0"):
        pytest.skip("needs a Neuron device and torch-neuronx or libtorch_neuronx_lite")
    importlib.import_module(plugin)  # registers the neuron device
    return plugin


@pytest.mark.neuron
def test_neuron_hardware_describe_register_verify():
    # must hold before this process's first device allocation (a fresh pytest process)
    os.environ.setdefault("NEURON_RT_MAP_HBM", "1")
    os.environ.setdefault("FI_EFA_USE_DEVICE_RDMA", "1")
    neuron_hardware_or_skip()

    nb, h, bs, d = 16, 2, 32, 128
    layers = [torch.zeros(2, nb, h, bs, d, dtype=torch.bfloat16, device="neuron:0")
              for _ in range(2)]  # allocating initialises the runtime
    backend = NeuronBackend()
    backend.prepare()
    g = describe_kv_caches(layers, backend=backend, num_kv_heads=h, head_size=d, block_size=bs,
                           tp_size=1, tp_rank=0, dtype="bfloat16")
    assert g.token_order == "HND" and g.block_stride == g.block_bytes
    agent = _nixl_agent("kv-push-neuron-test", backend.nixl_backends)
    descs = [(addr, n, g.dev_id, "") for addr, n in g.regions()]
    agent.register_memory(agent.get_reg_descs(descs, "VRAM"), backends=list(backend.nixl_backends))
    backend.verify_registration(g)
    host = torch.zeros(2, nb, h, bs, d, dtype=torch.bfloat16)  # host memory claimed as VRAM
    fake = G.kv_split(
        layer_bases=[(host.data_ptr(), host.data_ptr() + host.nbytes // 2)], num_kv_heads=h,
        head_size=d, dtype_bytes=2, dtype="bfloat16", block_size=bs, num_blocks=nb,
        token_order="HND", mem_type="VRAM")
    with pytest.raises(BackendError, match="is not Neuron HBM"):
        backend.verify_registration(fake)


@pytest.mark.cuda
@pytest.mark.skipif(not CudaBackend.available(), reason="needs a CUDA GPU")
def test_cuda_hardware_describe_register_verify():
    backend = CudaBackend()
    backend.prepare()
    nb, bs, h, d = 64, 16, 8, 128
    layers = [torch.randn(nb, 2, bs, h, d, device="cuda:0").to(torch.bfloat16)
              for _ in range(2)]
    g = describe_kv_caches(layers, backend=backend, num_kv_heads=h, head_size=d, block_size=bs,
                           tp_size=1, tp_rank=0, dtype="bfloat16")
    assert g.mem_type == "VRAM" and g.dev_id == 0 and g.token_order == "NHD"
    agent = _nixl_agent("kv-push-cuda-test", backend.nixl_backends[:1])
    descs = [(addr, n, g.dev_id, "") for addr, n in g.regions()]
    reg = agent.register_memory(agent.get_reg_descs(descs, "VRAM"))
    backend.verify_registration(g)  # cuPointerGetAttribute says device memory of GPU 0
    host = torch.zeros(nb, 2, bs, h, d, dtype=torch.bfloat16)
    host_g = G.blocks_first(layer_bases=[host.data_ptr()], num_kv_heads=h, head_size=d,
                            dtype_bytes=2, dtype="bfloat16", block_size=bs, num_blocks=nb,
                            mem_type="VRAM")
    with pytest.raises(BackendError, match="not CUDA device memory"):
        backend.verify_registration(host_g)
    agent.deregister_memory(reg)
