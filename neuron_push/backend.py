"""Neuron (Trainium) backend: KV in Neuron HBM, registered as NIXL VRAM through LIBFABRIC (EFA).

vllm-neuron 0.24 allocates each layer's KV as one ``(2, num_blocks, kv_heads, block_size,
head_size)`` tensor on the ``neuron`` device (dims "2BHTD", head-major HND); K and V become two
regions. What must hold, each guarded at start-up (docs/neuron.md cites the source of each rule;
none of them has run on Trainium):

* ``NEURON_RT_MAP_HBM`` truthy before the first device allocation, or ``data_ptr()`` is 0;
* ``libnrt.so.1`` loadable by that name and the runtime initialised before the NIXL agent
  exists. NIXL decides "Neuron" from an hwloc PCI scan (Amazon vendor 0x1d0f, Neuron device ids),
  not from the runtime; the order matters to libfabric, which sets up its HMEM interfaces once per
  process, at the first ``fi_getinfo`` (the agent's creation): it ``dlopen``s ``libnrt.so.1``
  then, and before libfabric 2.5.0 its EFA provider also allocated a Neuron buffer then, which
  fails before ``nrt_init`` and makes every later Neuron registration fail (``-FI_ENOSYS``);
* ``FI_EFA_USE_DEVICE_RDMA`` true, as libfabric parses it (AWS: required, not tuning);
* an EFA provider that offers ``FI_HMEM`` to NIXL's rail hints, asked in this process just
  before the agent is created (``libfabric.Libfabric.hmem_provider_available``): without it NIXL
  registers the HBM as ``FI_HMEM_SYSTEM`` with only a log line, and the memory is still HBM, so
  ``verify_registration`` could not tell;
* the NIXL backend is LIBFABRIC (UCX cannot register Neuron HBM), without NIXL's progress
  thread (see ``nixl_progress_thread``);
* P and D on one host need ``FI_EFA_ENABLE_SHM_TRANSFER`` read as 0, or outputs can be silently
  wrong;
* the model has no sliding-window attention and, on trn2, the engine's core slice starts at a
  multiple of its TP size (``check_model``).

Capabilities: the region path only. There is no ``alloc_staging``, so the staged path (pack
into a registered staging pool, a few large WRITEs, unpack on D) is never taken on Neuron, and
vLLM's per-layer ``save_kv_layer`` hook does not reach the connector there (vllm-neuron runs the
model as one compiled graph and calls the connector around it), so layer-wise streaming is not
available either. How pack/unpack could run on Trainium, and what stands in the way, is
docs/neuron.md, "Staged and layer-wise transfers on Trainium" (a design; nothing of it ran).

Every runtime access goes through ``NeuronRuntime``; tests pass a stand-in with its methods.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from typing import Any

from kv_push.common.backend import BackendError, verify_regions
from kv_push.common.geometry import KVGeometry

from . import libfabric as lf

logger = logging.getLogger(__name__)

LIBNRT = "libnrt.so.1"
NRT_SUCCESS, NRT_UNINITIALIZED, NRT_CLOSED = 0, 13, 14  # nrt/nrt_status.h
#: nrt/nrt.h instance families that are trn2 (TRN2, TRN2N, TRN2P, TRN2U, TRN2E, TRN2EU, TRN2AC,
#: TRN2UAC)
NRT_TRN2_FAMILIES = frozenset({5, 6, 8, 9, 10, 11, 12, 13})
#: the torch plugins that put tensors on the ``neuron`` device: torch-neuronx, and the
#: ``libtorch_neuronx_lite`` that Neuron SDK 2.32 ships for trn2/trn3 instead of it
TORCH_PLUGINS = ("torch_neuronx", "libtorch_neuronx_lite")
#: why this backend does not stage (``KVBackend``'s optional ``staging_unsupported``)
STAGING_UNSUPPORTED = (
    "the neuron backend has no staging pool: packing on Trainium needs an on-device gather "
    "that is designed but not built; see docs/neuron.md, 'Staged and layer-wise transfers on "
    "Trainium'")


class _InstanceInfo(ctypes.Structure):  # nrt_instance_info_t
    _fields_ = [("family", ctypes.c_uint32), ("size", ctypes.c_uint32),
                ("arch_name", ctypes.c_char * 16), ("device_revision", ctypes.c_char * 8)]


class NeuronRuntime:
    """The process's Neuron runtime, through libnrt's documented C API (nrt/nrt.h), libfabric,
    and the environment."""

    def __init__(self, lib_name: str = LIBNRT, fabric_lib: str = lf.LIBFABRIC):
        self.lib_name = lib_name
        self.fabric_lib = fabric_lib
        self._lib: Any = None

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def _load(self) -> Any:
        if self._lib is None:
            lib = ctypes.CDLL(self.lib_name)  # by name, as NIXL's LIBFABRIC plugin dlopens it
            f = lib.nrt_get_attached_efa_bdf  # runtime 2.31+ (Neuron 2.29)
            f.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]
            f.restype = ctypes.c_int
            g = lib.nrt_get_vnc_memory_stats
            g.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t,
                          ctypes.POINTER(ctypes.c_size_t)]
            g.restype = ctypes.c_int
            self._lib = lib
        return self._lib

    def lib_loadable(self) -> bool:
        try:
            self._load()
        except (OSError, AttributeError):  # not found, or too old to have the symbols
            return False
        return True

    def initialised(self) -> bool | None:
        """True/False when libnrt says so, None when it cannot tell.

        nrt.h has no "is initialised" call. NRT_UNINITIALIZED / NRT_CLOSED exist "to help the
        caller identify when nrt apis are called outside the scope of nrt_init() and nrt_close()"
        (nrt_status.h); that nrt_get_vnc_memory_stats returns them is our reading, not documented
        per function, so any other failure is "cannot tell".
        """
        stats, written = (ctypes.c_size_t * 2)(), ctypes.c_size_t(0)
        rc = self._load().nrt_get_vnc_memory_stats(
            0, ctypes.byref(stats), ctypes.sizeof(stats), ctypes.byref(written)
        )
        if rc == NRT_SUCCESS:
            return True
        return False if rc in (NRT_UNINITIALIZED, NRT_CLOSED) else None

    def efa_hmem(self) -> bool | None:
        """Whether libfabric's EFA provider offers FI_HMEM to NIXL's rail hints in this process;
        None when libfabric.so.1 cannot be loaded. Call it only when the NIXL agent is next: the
        first ``fi_getinfo`` of the process fixes libfabric's HMEM state for good."""
        try:
            fabric = lf.Libfabric(self.fabric_lib)
        except (OSError, AttributeError):
            return None
        return fabric.hmem_provider_available("efa")

    def instance_family(self) -> int | None:
        """nrt.h's NRT_INSTANCE_* family of this instance; None when libnrt cannot say."""
        try:
            f = self._load().nrt_get_instance_info
        except (OSError, AttributeError):
            return None
        info = _InstanceInfo()
        rc = f(ctypes.byref(info), ctypes.c_size_t(ctypes.sizeof(info)))
        return int(info.family) if rc == NRT_SUCCESS else None

    def efa_device(self, addr: int) -> str | None:
        """PCI address of the EFA device serving the HBM at ``addr``; None if not Neuron HBM.

        nrt.h documents the call for the "VA of a memory allocated on a Neuron device"; NIXL's
        LIBFABRIC backend makes it with each registered region's base address.
        """
        buf, size = ctypes.create_string_buffer(64), ctypes.c_size_t(64)
        rc = self._load().nrt_get_attached_efa_bdf(ctypes.c_void_p(addr), buf, ctypes.byref(size))
        return buf.value.decode() if rc == NRT_SUCCESS else None

    def device_index(self, tensor: Any) -> int:
        device = tensor.device
        if device.type not in ("neuron", "privateuseone"):
            raise BackendError(f"neuron backend got a tensor on {device}, not on a Neuron device")
        return int(device.index or 0)

    @staticmethod
    def torch_plugin() -> str | None:
        """The importable module that gives torch the ``neuron`` device, or None."""
        for name in TORCH_PLUGINS:
            try:
                if importlib.util.find_spec(name) is not None:
                    return name
            except (ImportError, ValueError):
                continue
        return None

    @staticmethod
    def present() -> bool:
        return NeuronRuntime.torch_plugin() is not None or os.path.exists("/dev/neuron0")


def _truthy(value: str | None) -> bool:
    """NEURON_RT_MAP_HBM as libtorchneuron reads it: "true" or a positive integer."""
    v = (value or "").strip().lower()
    return v == "true" or (v.isdigit() and int(v) > 0)


def core_slice(value: str | None) -> list[int] | None:
    """Core ids of a ``NEURON_VISIBLE_DEVICES`` value ("0-3", "8,9,10,11"); None when unset."""
    if value is None or not value.strip():
        return None
    cores: list[int] = []
    try:
        for part in value.split(","):
            lo, sep, hi = part.strip().partition("-")
            cores.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        raise BackendError(
            f"NEURON_VISIBLE_DEVICES={value!r} is not a core list or range") from None
    return cores


class NeuronBackend:
    """KV cache in Neuron HBM (needs torch-neuronx, libtorch_neuronx_lite or /dev/neuron0)."""

    name = "neuron"
    mem_type = "VRAM"
    #: NIXL backends the transport must create: UCX cannot register Neuron HBM
    nixl_backends = ("LIBFABRIC",)
    #: NIXL's progress thread stays off for LIBFABRIC as for UCX. From NIXL 1.4.0 the first
    #: transfer or notification to a peer waits for that peer's LIBFABRIC handshake (up to a
    #: compiled-in 60 s) with or without the thread -- the thread only changes how it waits -- so
    #: the thread cannot bound that wait; the transfer thread avoids it instead by never making
    #: the first call to a peer that has not been heard from (docs/neuron.md, "NIXL versions").
    nixl_progress_thread = False
    #: no ``alloc_staging``: the worker logs this (and names it when a pool is configured)
    staging_unsupported = STAGING_UNSUPPORTED

    def __init__(self, runtime: Any = None):
        self.runtime = runtime if runtime is not None else NeuronRuntime()

    @classmethod
    def available(cls) -> bool:
        return NeuronRuntime.present()

    def prepare(self, colocated: bool = False) -> None:
        rt = self.runtime
        map_hbm = rt.env("NEURON_RT_MAP_HBM")
        if not _truthy(map_hbm):
            raise BackendError(
                f"NEURON_RT_MAP_HBM={map_hbm!r}: set NEURON_RT_MAP_HBM=1 before "
                "the process allocates its first Neuron tensor, or KV tensors have data_ptr() == 0 "
                "and cannot be registered (vllm-neuron's worker sets it; other launchers must)"
            )
        self._check_efa_env(colocated)
        if not rt.lib_loadable():
            raise BackendError(
                f"cannot load {LIBNRT} by name (ctypes.CDLL({LIBNRT!r})) or it lacks "
                "nrt_get_attached_efa_bdf (Neuron runtime 2.31+): libfabric and NIXL's LIBFABRIC "
                "plugin load it by that name to register Neuron HBM; put /opt/aws/neuron/lib on "
                "LD_LIBRARY_PATH"
            )
        initialised = rt.initialised()
        if initialised is False:
            raise BackendError(
                "the Neuron runtime is not initialised: the NIXL agent must be created after it "
                "(allocate a device tensor first; vllm-neuron initialises it in init_device). "
                "libfabric sets up Neuron memory support once, at the first fi_getinfo of the "
                "process (the agent's creation); before libfabric 2.5.0 that fails before "
                "nrt_init and every Neuron registration then fails with -FI_ENOSYS"
            )
        if initialised is None:
            logger.warning(
                "kv_push neuron: could not tell whether the Neuron runtime is initialised; the "
                "FI_HMEM check below still sees what NIXL will see"
            )
        self._check_fi_hmem()
        logger.info(
            "kv_push neuron: NIXL backend LIBFABRIC; each Neuron device's HBM reaches the network "
            "through the one EFA device attached to it (about 25 GB/s, one 200 Gb/s rail on "
            "trn2.48xlarge): spread P and D ranks over devices so transfers use different rails"
        )

    def _check_efa_env(self, colocated: bool) -> None:
        """FI_EFA_USE_DEVICE_RDMA and FI_EFA_ENABLE_SHM_TRANSFER, read as libfabric reads them."""
        rdma = self.runtime.env("FI_EFA_USE_DEVICE_RDMA")
        try:
            on = lf.fi_bool(rdma)
        except lf.LibfabricValueError as e:
            raise BackendError(f"FI_EFA_USE_DEVICE_RDMA: {e}; libfabric's EFA provider aborts "
                               "the process on it. Set FI_EFA_USE_DEVICE_RDMA=1") from None
        if not on:
            raise BackendError(
                f"FI_EFA_USE_DEVICE_RDMA={rdma!r}: set FI_EFA_USE_DEVICE_RDMA=1 in every P and D "
                "server. AWS documents it as required for NIXL's LIBFABRIC path, not tuning; "
                "without it the first transfer can stall with no start-up error, and when it is "
                "false libfabric offers no FI_HMEM, so NIXL registers the KV as host memory"
            )
        shm = self.runtime.env("FI_EFA_ENABLE_SHM_TRANSFER")
        if colocated and lf.fi_int(shm) != 0:
            raise BackendError(
                f"prefill and decode share this host but FI_EFA_ENABLE_SHM_TRANSFER={shm!r} "
                "(libfabric reads it as an integer; unset means 1): set it to 0 in both "
                "servers, or libfabric's shared-memory path can silently give inaccurate outputs "
                "(vllm-neuron's DI tutorial)"
            )
        if colocated and shm is not None and shm.strip().lower() in ("true", "yes", "on"):
            logger.warning("kv_push neuron: FI_EFA_ENABLE_SHM_TRANSFER=%r is an integer to "
                           "libfabric and reads as 0 (shared memory off); write 0", shm)

    def _check_fi_hmem(self) -> None:
        try:
            hmem = self.runtime.efa_hmem()
        except lf.LibfabricError as e:
            raise BackendError(f"asking libfabric for an FI_HMEM-capable EFA provider failed "
                               f"({e}); NIXL's LIBFABRIC plugin needs libfabric 1.21 or later"
                               ) from None
        if hmem is None:
            raise BackendError(
                f"cannot load {lf.LIBFABRIC}: NIXL's LIBFABRIC plugin needs it; put "
                "/opt/amazon/efa/lib64 on LD_LIBRARY_PATH (the Neuron DLAMI ships EFA)"
            )
        if not hmem:
            raise BackendError(
                "libfabric's EFA provider offers no FI_HMEM in this process (fi_getinfo with "
                "NIXL's hints): NIXL would register the Neuron KV as FI_HMEM_SYSTEM and log only "
                "'VRAM memory requested but provider does not support FI_HMEM'. Causes: "
                "libnrt.so.1 neither loaded nor on the loader path when libfabric first ran in "
                "this process, FI_EFA_USE_DEVICE_RDMA=0, FI_HMEM_DISABLE_P2P=1, an FI_HMEM list "
                "without neuron, an EFA device without RDMA read, a libfabric built without "
                "Neuron support. Check with "
                "FI_LOG_LEVEL=info"
            )

    def check_model(self, *, sliding_window: int | None, tp_size: int) -> None:
        """Refuse what this backend cannot serve correctly; call before the KV cache exists.

        * A sliding-window model: Neuron's sliding-window KV needs a transfer alignment that only
          AWS's own connector implements ("NeuronNixlConnector -- required for GPT-OSS because
          the generic NixlConnector does not include Neuron's sliding-window transfer
          alignment"); this connector does not, so such models are refused until it does.
        * On trn2, an engine's core slice (``NEURON_VISIBLE_DEVICES``) must start at a multiple
          of its TP size: a misaligned slice compiles and then fails in prefill warmup.
        """
        if sliding_window:
            raise BackendError(
                f"this model uses sliding-window attention (window {sliding_window}): on Neuron "
                "its KV needs a transfer alignment kv_push does not implement yet; serve it with "
                "vllm-neuron's NeuronNixlConnector"
            )
        cores = core_slice(self.runtime.env("NEURON_VISIBLE_DEVICES"))
        if cores and tp_size > 1 and cores[0] % tp_size:
            family = self.runtime.instance_family()
            if family in NRT_TRN2_FAMILIES:
                raise BackendError(
                    f"NEURON_VISIBLE_DEVICES starts at core {cores[0]}, not a multiple of the "
                    f"tensor-parallel size {tp_size}: on trn2 the TP group's collectives cannot "
                    f"be mapped and prefill warmup fails; start the slice at a multiple of "
                    f"{tp_size} (e.g. {cores[0] - cores[0] % tp_size}-"
                    f"{cores[0] - cores[0] % tp_size + len(cores) - 1})"
                )
            if family is None:
                logger.warning(
                    "kv_push neuron: NEURON_VISIBLE_DEVICES starts at core %d, not a multiple of "
                    "TP %d, and the instance type is unknown: on trn2 that fails in warmup",
                    cores[0], tp_size)

    def device_id(self, tensor: Any) -> int:
        return self.runtime.device_index(tensor)

    def verify_registration(self, geometry: KVGeometry) -> None:
        # nrt_get_attached_efa_bdf is documented for an allocation's address; a region's base is
        # what NIXL's LIBFABRIC backend passes it when registering that region: probe only that
        rails = set(verify_regions(self, geometry, self._efa_of, last_byte=False))
        logger.info(
            "kv_push neuron: tp_rank %d KV (%d regions) is Neuron HBM on device %d, EFA %s",
            geometry.tp_rank, len(geometry.regions()), geometry.dev_id, ", ".join(sorted(rails)),
        )

    def _efa_of(self, addr: int) -> str:
        efa = self.runtime.efa_device(addr)
        if efa is None:
            raise BackendError(
                f"KV address {addr:#x} is not Neuron HBM according to the Neuron runtime "
                "(nrt_get_attached_efa_bdf): registering it as VRAM would move host memory or fail"
            )
        return efa
