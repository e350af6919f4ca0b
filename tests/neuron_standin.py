"""A stand-in for the Neuron runtime surface that ``NeuronBackend`` uses, for machines without one.

``FakeNeuronRuntime`` has the methods of ``kv_push.neuron_push.backend.NeuronRuntime`` and models
the behaviour the backend guards against:

* a "device" tensor is real host memory (a numpy buffer) so its bytes can be inspected, and
  ``data_ptr()`` returns 0 unless NEURON_RT_MAP_HBM was truthy when it was allocated (what
  libtorchneuron's allocator does);
* the first allocation initialises the runtime (as torch-neuronx's does), recorded in ``events``;
* only addresses inside allocations count as "device memory"; each device index is served by one
  EFA device (a PCI address), as ``nrt_get_attached_efa_bdf`` reports;
* ``lib_loadable`` and the initialised state can be set to model a missing or late runtime;
* libfabric's FI_HMEM answer (``efa_hmem``), as ``fi_getinfo`` with NIXL's hints gives it:
  libfabric loads ``libnrt.so.1`` once per process, at its first ``fi_getinfo``, so whether the
  runtime library was visible then is fixed by the first call (``early_fi_getinfo`` models another
  library calling it first); it is also False when ``FI_EFA_USE_DEVICE_RDMA`` reads false,
  ``FI_HMEM_DISABLE_P2P`` true or the EFA device lacks RDMA read (``prov/efa/src/
  efa_user_info.c``), None without libfabric, and an error from a libfabric older than API 1.18.
  (What libfabric before 2.5.0 does when ``nrt_init`` comes late -- FI_HMEM offered, then
  ``-FI_ENOSYS`` at registration -- is not modelled: no query shows it before registering.)
* ``efa_device`` records every address it is asked about (``probed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kv_push.common.backend import BackendError
from kv_push.neuron_push import libfabric as lf


@dataclass(frozen=True)
class FakeDevice:
    type: str
    index: int | None = 0

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


class StandinTensor:
    """Duck-typed like a torch tensor for ``describe_kv_caches`` (strides in elements)."""

    def __init__(self, buf: np.ndarray, shape, strides, device: FakeDevice, mapped: bool):
        self._buf = buf  # keeps the memory alive
        self.shape = tuple(shape)
        self._strides = tuple(strides)
        self.device = device
        self._mapped = mapped

    def data_ptr(self) -> int:
        return int(self._buf.ctypes.data) if self._mapped else 0

    def stride(self) -> tuple[int, ...]:
        return self._strides

    def element_size(self) -> int:
        return int(self._buf.itemsize)

    def numpy(self) -> np.ndarray:
        """The elements as an array view (for checking bytes)."""
        es = self._buf.itemsize
        return np.lib.stride_tricks.as_strided(
            self._buf, self.shape, tuple(s * es for s in self._strides)
        )


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


class FakeNeuronRuntime:
    def __init__(
        self,
        env: dict[str, str] | None = None,
        *,
        lib_loadable: bool = True,
        initialised: bool | None = False,
        efa_by_device: dict[int, str] | None = None,
        fabric: tuple[int, int] | None = (2, 5),
        efa_rdma_read: bool = True,
        family: int | None = None,
    ):
        self.environ = dict(env or {})
        self._lib_loadable = lib_loadable
        self._initialised = initialised
        self.efa_by_device = efa_by_device or {0: "0000:10:1c.0", 1: "0000:20:1c.0"}
        self.fabric = fabric  # libfabric version; None: libfabric.so.1 not loadable
        self.efa_rdma_read = efa_rdma_read
        self.family = family  # nrt.h NRT_INSTANCE_* (5: TRN2, 14: TRN3); None: unknown
        self._hmem: bool | None = None  # fixed at the first fi_getinfo
        self.allocations: list[tuple[int, int, int]] = []  # (address, bytes, device index)
        self.events: list[str] = []
        self.probed: list[int] = []

    # -- the NeuronRuntime surface ---------------------------------------------------------
    def env(self, name: str) -> str | None:
        return self.environ.get(name)

    def lib_loadable(self) -> bool:
        return self._lib_loadable

    def initialised(self) -> bool | None:
        return self._initialised

    def efa_hmem(self) -> bool | None:
        if self.fabric is None:
            return None
        if self.fabric < (1, 18):
            raise lf.LibfabricError("fi_getinfo('efa') returned -38")  # -FI_ENOSYS
        if self._hmem is None:  # libfabric's fi_ini: once per process
            self.events.append("fi_getinfo")
            self._hmem = self._lib_loadable and self.efa_rdma_read
        rdma = lf.fi_bool(self.environ.get("FI_EFA_USE_DEVICE_RDMA"))
        p2p_off = lf.fi_bool(self.environ.get("FI_HMEM_DISABLE_P2P"))
        return self._hmem and rdma is not False and not p2p_off

    def instance_family(self) -> int | None:
        return self.family

    def early_fi_getinfo(self) -> None:
        """Another library in the process calls fi_getinfo now (libfabric's state is fixed)."""
        if self.fabric is not None and self._hmem is None:
            self.events.append("fi_getinfo")
            self._hmem = self._lib_loadable and self.efa_rdma_read

    def efa_device(self, addr: int) -> str | None:
        self.probed.append(addr)
        for base, n, device in self.allocations:
            if base <= addr < base + n:
                return self.efa_by_device[device]
        return None

    def device_index(self, tensor) -> int:
        if tensor.device.type not in ("neuron", "privateuseone"):
            raise BackendError(f"neuron backend got a tensor on {tensor.device}")
        return int(tensor.device.index or 0)

    # -- what torch-neuronx would do -------------------------------------------------------
    def empty(self, shape, dtype=np.float16, device_index: int = 0) -> StandinTensor:
        """A new "device" tensor; mapped only if NEURON_RT_MAP_HBM is set now."""
        if not self._initialised:
            self._initialised = True
            self.events.append("nrt_init")
        mapped = (self.env("NEURON_RT_MAP_HBM") or "").strip().lower() in ("1", "true")
        buf = np.zeros(int(np.prod(shape)), dtype=dtype)
        self.allocations.append((int(buf.ctypes.data), buf.nbytes, device_index))
        self.events.append(f"alloc:{buf.nbytes}" + ("" if mapped else ":unmapped"))
        return StandinTensor(buf, shape, _contiguous_strides(shape),
                             FakeDevice("neuron", device_index), mapped)

    def host_tensor(self, shape, dtype=np.float16, device_index: int = 0) -> StandinTensor:
        """A tensor that claims to be on the Neuron device but lives in host memory (a fallback)."""
        buf = np.zeros(int(np.prod(shape)), dtype=dtype)
        return StandinTensor(buf, shape, _contiguous_strides(shape),
                             FakeDevice("neuron", device_index), True)
