"""Neuron (Trainium) backend: KV in Neuron HBM, registered as NIXL VRAM through LIBFABRIC (EFA).

vllm-neuron 0.24 allocates each layer's KV as one ``(2, num_blocks, kv_heads, block_size,
head_size)`` tensor on the ``neuron`` device (dims "2BHTD", head-major HND); K and V become two
regions. What must hold, each guarded at start-up (docs/neuron.md cites the sources):

* ``NEURON_RT_MAP_HBM=1`` before the first device allocation, or ``data_ptr()`` is 0;
* ``libnrt.so.1`` loadable by that name and the runtime initialised before the NIXL agent exists:
  NIXL's LIBFABRIC plugin asks libnrt (``nrt_get_attached_efa_bdf``) which EFA device serves an
  address, and decides at agent creation whether VRAM means Neuron; otherwise VRAM registration
  fails or silently becomes host memory (``FI_HMEM_SYSTEM``);
* the NIXL backend is LIBFABRIC (UCX cannot register Neuron HBM);
* P and D on one host need ``FI_EFA_ENABLE_SHM_TRANSFER=0``, or outputs can be silently wrong.

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

logger = logging.getLogger(__name__)

LIBNRT = "libnrt.so.1"
NRT_SUCCESS, NRT_UNINITIALIZED, NRT_CLOSED = 0, 13, 14  # nrt/nrt_status.h


class NeuronRuntime:
    """The process's Neuron runtime, through libnrt's documented C API (nrt/nrt.h) and the env."""

    def __init__(self, lib_name: str = LIBNRT):
        self.lib_name = lib_name
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

    def efa_device(self, addr: int) -> str | None:
        """PCI address of the EFA device serving the HBM at ``addr``; None if not Neuron HBM.

        The same call NIXL's LIBFABRIC backend makes when it registers Neuron VRAM.
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
    def present() -> bool:
        try:
            if importlib.util.find_spec("torch_neuronx") is not None:
                return True
        except (ImportError, ValueError):
            pass
        return os.path.exists("/dev/neuron0")


def _truthy(value: str | None) -> bool:
    """NEURON_RT_MAP_HBM as libtorchneuron reads it: "true" or a positive integer."""
    v = (value or "").strip().lower()
    return v == "true" or (v.isdigit() and int(v) > 0)


class NeuronBackend:
    """KV cache in Neuron HBM (needs torch-neuronx or /dev/neuron0)."""

    name = "neuron"
    mem_type = "VRAM"
    #: NIXL backends the transport must create: UCX cannot register Neuron HBM
    nixl_backends = ("LIBFABRIC",)

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
        if not rt.lib_loadable():
            raise BackendError(
                f"cannot load {LIBNRT} by name (ctypes.CDLL({LIBNRT!r})) or it lacks "
                "nrt_get_attached_efa_bdf (Neuron runtime 2.31+): NIXL's LIBFABRIC plugin loads it "
                "by that name to register Neuron HBM; put /opt/aws/neuron/lib on LD_LIBRARY_PATH"
            )
        initialised = rt.initialised()
        if initialised is False:
            raise BackendError(
                "the Neuron runtime is not initialised: the NIXL agent must be created after it "
                "(allocate a device tensor first; vllm-neuron initialises it in init_device), "
                "otherwise LIBFABRIC treats VRAM as host memory"
            )
        if initialised is None:
            logger.warning(
                "kv_push neuron: could not tell whether the Neuron runtime is initialised; "
                "verify_registration will check that the KV really is Neuron HBM"
            )
        shm = rt.env("FI_EFA_ENABLE_SHM_TRANSFER")
        if colocated and shm != "0":
            raise BackendError(
                f"prefill and decode share this host but FI_EFA_ENABLE_SHM_TRANSFER={shm!r}: set "
                "it to 0 in both servers, or libfabric's shared-memory path can silently give "
                "inaccurate outputs (vllm-neuron's DI tutorial)"
            )
        logger.info(
            "kv_push neuron: NIXL backend LIBFABRIC; each Neuron device's HBM reaches the network "
            "through the one EFA device attached to it (about 25 GB/s, one 200 Gb/s rail on "
            "trn2.48xlarge): spread P and D ranks over devices so transfers use different rails"
        )

    def device_id(self, tensor: Any) -> int:
        return self.runtime.device_index(tensor)

    def verify_registration(self, geometry: KVGeometry) -> None:
        rails = set(verify_regions(self, geometry, self._efa_of))
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
