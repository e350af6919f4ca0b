"""What libfabric will do in this process, asked the way libfabric itself answers it.

Two things the Neuron backend must know before the NIXL LIBFABRIC agent exists:

* how libfabric reads the ``FI_*`` variables that decide the EFA path. Its parser
  (``src/var.c``: ``fi_param_get``, ``fi_parse_bool``) takes a *bool* parameter as ``0``/``1``
  exactly or ``false``/``true``, ``no``/``yes``, ``off``/``on`` in any case, and anything else is
  an error (for ``FI_EFA_USE_DEVICE_RDMA`` the EFA provider then calls ``abort()``); an *int*
  parameter is ``strtol(value, NULL, 0)``, so a word such as ``false`` reads as 0.
  ``FI_EFA_USE_DEVICE_RDMA`` is a bool, ``FI_EFA_ENABLE_SHM_TRANSFER`` an int (``prov/efa/src/
  efa_env.c``), in every release from 1.21 (NIXL's minimum) to 2.6. ``fi_bool`` and ``fi_int``
  reproduce both readings; a value from libfabric's config file is not seen here.
* whether an EFA provider offers ``FI_HMEM``. NIXL's LIBFABRIC rails ask ``fi_getinfo`` for
  ``FI_MSG | FI_RMA | FI_HMEM`` and, when that fails, retry without ``FI_HMEM`` and register
  every VRAM region as ``FI_HMEM_SYSTEM`` (``src/utils/libfabric/libfabric_rail.cpp``), logging
  only an INFO line at agent creation and a WARN at registration. ``hmem_provider_available``
  makes the same ``fi_getinfo`` call with the same hints, in this process, so its answer is the
  one NIXL will get: libfabric initialises its HMEM interfaces once per process, at the first
  ``fi_getinfo`` (``src/fabric.c``: ``fi_ini`` -> ``ofi_hmem_init``).

``ctypes`` only; the struct offsets are those of ``include/rdma/fabric.h``, unchanged from 1.x to
2.6 for the fields used.
"""

from __future__ import annotations

import ctypes
import re

LIBFABRIC = "libfabric.so.1"

# include/rdma/fabric.h
FI_MSG = 1 << 1
FI_RMA = 1 << 2
FI_HMEM = 1 << 47
FI_LOCAL_COMM = 1 << 51
FI_REMOTE_COMM = 1 << 52
FI_CONTEXT = 1 << 59
FI_EP_RDM = 3
FI_THREAD_COMPLETION = 4
FI_MR_LOCAL = 1 << 2
FI_MR_VIRT_ADDR = 1 << 4
FI_MR_ALLOCATED = 1 << 5
FI_MR_PROV_KEY = 1 << 6
FI_MR_HMEM = 1 << 10
FI_ENODATA = 61  # FI_ENODATA == ENODATA (include/rdma/fi_errno.h)
#: the mr_mode NIXL's rails ask of EFA and other non-tcp providers
NIXL_EFA_MR_MODE = FI_MR_LOCAL | FI_MR_HMEM | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY


def fi_version(major: int, minor: int) -> int:
    return (major << 16) | minor


#: the API version NIXL's LIBFABRIC plugin asks for (``fi_getinfo(FI_VERSION(1, 18), ...)``)
NIXL_FI_VERSION = fi_version(1, 18)

_TRUE = ("true", "yes", "on")
_FALSE = ("false", "no", "off")


class LibfabricValueError(ValueError):
    """A value libfabric itself would refuse."""


def fi_bool(value: str | None) -> bool | None:
    """A bool ``FI_*`` variable as libfabric reads it: None when unset.

    Raises ``LibfabricValueError`` for a value libfabric rejects (for ``FI_EFA_USE_DEVICE_RDMA``
    the EFA provider aborts the process on it).
    """
    if value is None:
        return None
    if value == "1" or value.lower() in _TRUE:
        return True
    if value == "0" or value.lower() in _FALSE:
        return False
    raise LibfabricValueError(
        f"{value!r} is not a libfabric boolean (0/1, false/true, no/yes, off/on)")


_STRTOL = re.compile(r"\s*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)")


def fi_int(value: str | None) -> int | None:
    """An int ``FI_*`` variable as libfabric reads it (``strtol(value, NULL, 0)``): None when
    unset, 0 when the value does not start with a number (``"false"``, ``"off"``, ``""``)."""
    if value is None:
        return None
    m = _STRTOL.match(value)
    if m is None:
        return 0
    sign, digits = m.groups()
    if digits.lower().startswith("0x"):
        n = int(digits, 16)
    elif digits.startswith("0") and len(digits) > 1:
        n = int(digits, 8)
    else:
        n = int(digits)
    return -n if sign == "-" else n


# -- fi_getinfo through ctypes --------------------------------------------------------------


class _FabricAttr(ctypes.Structure):
    _fields_ = [("fabric", ctypes.c_void_p), ("name", ctypes.c_char_p),
                ("prov_name", ctypes.c_void_p), ("prov_version", ctypes.c_uint32),
                ("api_version", ctypes.c_uint32)]


class _DomainAttr(ctypes.Structure):  # leading fields only: libfabric allocates the struct
    _fields_ = [("domain", ctypes.c_void_p), ("name", ctypes.c_void_p),
                ("threading", ctypes.c_int), ("control_progress", ctypes.c_int),
                ("data_progress", ctypes.c_int), ("resource_mgmt", ctypes.c_int),
                ("av_type", ctypes.c_int), ("mr_mode", ctypes.c_int),
                ("mr_key_size", ctypes.c_size_t)]


class _EpAttr(ctypes.Structure):  # leading field only
    _fields_ = [("type", ctypes.c_int)]


class _Info(ctypes.Structure):
    pass


_Info._fields_ = [
    ("next", ctypes.POINTER(_Info)), ("caps", ctypes.c_uint64), ("mode", ctypes.c_uint64),
    ("addr_format", ctypes.c_uint32), ("src_addrlen", ctypes.c_size_t),
    ("dest_addrlen", ctypes.c_size_t), ("src_addr", ctypes.c_void_p),
    ("dest_addr", ctypes.c_void_p), ("handle", ctypes.c_void_p), ("tx_attr", ctypes.c_void_p),
    ("rx_attr", ctypes.c_void_p), ("ep_attr", ctypes.POINTER(_EpAttr)),
    ("domain_attr", ctypes.POINTER(_DomainAttr)), ("fabric_attr", ctypes.POINTER(_FabricAttr)),
    ("nic", ctypes.c_void_p),
]


class LibfabricError(RuntimeError):
    """fi_getinfo failed for a reason other than "no provider matches"."""


class Libfabric:
    """The process's libfabric, loaded by name as NIXL's LIBFABRIC plugin links it."""

    def __init__(self, lib_name: str = LIBFABRIC):
        lib = ctypes.CDLL(lib_name)  # OSError when libfabric is not on the loader path
        self._getinfo = lib.fi_getinfo
        self._getinfo.argtypes = [ctypes.c_uint32, ctypes.c_char_p, ctypes.c_char_p,
                                  ctypes.c_uint64, ctypes.POINTER(_Info),
                                  ctypes.POINTER(ctypes.POINTER(_Info))]
        self._getinfo.restype = ctypes.c_int
        self._dupinfo = lib.fi_dupinfo  # fi_allocinfo() is fi_dupinfo(NULL)
        self._dupinfo.argtypes = [ctypes.POINTER(_Info)]
        self._dupinfo.restype = ctypes.POINTER(_Info)
        self._freeinfo = lib.fi_freeinfo
        self._freeinfo.argtypes = [ctypes.POINTER(_Info)]
        self._freeinfo.restype = None
        self._strdup = ctypes.CDLL(None).strdup  # fi_freeinfo frees the hint strings
        self._strdup.argtypes = [ctypes.c_char_p]
        self._strdup.restype = ctypes.c_void_p

    def providers(self, provider: str, *, caps: int, mr_mode: int,
                  api_version: int = NIXL_FI_VERSION) -> list[str]:
        """Names of the providers ``fi_getinfo`` offers for these hints (``[]``: none match).

        The hints are those of NIXL's rails: ``caps``, mode ``FI_CONTEXT``, an RDM endpoint,
        completion threading, ``mr_mode`` (key size 2 when ``FI_MR_PROV_KEY``), restricted to
        ``provider``.
        """
        hints = self._dupinfo(None)
        if not hints:
            raise LibfabricError("fi_allocinfo failed")
        info = ctypes.POINTER(_Info)()
        try:
            h = hints.contents
            h.caps = caps
            h.mode = FI_CONTEXT
            h.ep_attr.contents.type = FI_EP_RDM
            dom = h.domain_attr.contents
            dom.threading = FI_THREAD_COMPLETION
            dom.mr_mode = mr_mode
            dom.mr_key_size = 2 if mr_mode & FI_MR_PROV_KEY else 0
            h.fabric_attr.contents.prov_name = self._strdup(provider.encode())
            rc = self._getinfo(api_version, None, None, 0, hints, ctypes.byref(info))
            if rc == -FI_ENODATA:
                return []
            if rc != 0:
                raise LibfabricError(f"fi_getinfo({provider!r}) returned {rc}")
            names, cur = [], info
            while cur:
                fab = cur.contents.fabric_attr
                raw = fab.contents.prov_name if fab else None
                names.append(ctypes.string_at(raw).decode() if raw else "")
                cur = cur.contents.next
            return names
        finally:
            if info:
                self._freeinfo(info)
            self._freeinfo(hints)

    def hmem_provider_available(self, provider: str = "efa") -> bool:
        """Whether ``provider`` offers FI_HMEM to NIXL's rail hints, in this process, now.

        False means NIXL's LIBFABRIC backend will register VRAM as ``FI_HMEM_SYSTEM``.
        """
        caps = FI_MSG | FI_RMA | FI_HMEM | FI_LOCAL_COMM | FI_REMOTE_COMM
        return bool(self.providers(provider, caps=caps, mr_mode=NIXL_EFA_MR_MODE))
