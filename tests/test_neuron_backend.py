"""The Neuron backend's rules from the public NIXL, libfabric and Neuron sources (issue 13).

Everything runs against ``neuron_standin.FakeNeuronRuntime`` (no Trainium was reachable); the
libfabric helpers also run against a real ``libfabric.so.1`` where one is installed (skipped
otherwise). docs/neuron.md cites the source of each rule.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import pathlib
import threading
import time
import tomllib
from types import SimpleNamespace

import pytest

from kv_push.common import geometry as G
from kv_push.common.backend import BackendError
from kv_push.common.config import PushConfig
from kv_push.common.kv_tensors import describe_kv_caches
from kv_push.common.messages import (
    PROTOCOL_VERSION,
    Codec,
    Heartbeat,
    Hello,
    MessageRejected,
    Welcome,
    geometry_digest,
)
from kv_push.common.metrics import Counters
from kv_push.common.nixl_compat import check_peer_nixl, libfabric_waits_for_handshake
from kv_push.common.transfer_thread import TransferThread
from kv_push.common.worker import PushWorker
from kv_push.neuron_push import backend as nb
from kv_push.neuron_push import libfabric as lf
from kv_push.neuron_push.backend import NeuronBackend, NeuronRuntime, core_slice
from fakes import FakeTransport, Wire
from neuron_standin import FakeNeuronRuntime

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {"NEURON_RT_MAP_HBM": "1", "FI_EFA_USE_DEVICE_RDMA": "1"}
TRN2, TRN3 = 5, 14  # nrt.h NRT_INSTANCE_TRN2 / NRT_INSTANCE_TRN3


def runtime(**kw) -> FakeNeuronRuntime:
    env = {**ENV, **kw.pop("env", {})}
    return FakeNeuronRuntime({k: v for k, v in env.items() if v is not None},
                             initialised=kw.pop("initialised", True), **kw)


# -- 1. the FI_HMEM_SYSTEM fallback, seen by asking libfabric what NIXL will ask ----------------


def test_prepare_asks_libfabric_for_fi_hmem_and_passes_when_offered():
    rt = runtime()
    NeuronBackend(runtime=rt).prepare()
    assert rt.events == ["fi_getinfo"]


def test_prepare_fails_when_libfabric_offers_no_fi_hmem():
    # another library ran fi_getinfo before libnrt was loaded: libfabric never loads it again,
    # NIXL would register the KV as FI_HMEM_SYSTEM, and the memory would still be HBM
    rt = runtime(lib_loadable=False)
    rt.early_fi_getinfo()
    rt._lib_loadable = True
    with pytest.raises(BackendError, match="offers no FI_HMEM.*FI_HMEM_SYSTEM"):
        NeuronBackend(runtime=rt).prepare()


@pytest.mark.parametrize("env, kw", [
    ({"FI_HMEM_DISABLE_P2P": "1"}, {}),
    ({}, {"efa_rdma_read": False}),
])
def test_prepare_fails_on_the_other_causes_of_no_fi_hmem(env, kw):
    with pytest.raises(BackendError, match="offers no FI_HMEM"):
        NeuronBackend(runtime=runtime(env=env, **kw)).prepare()


def test_prepare_refuses_before_libfabric_is_asked_when_the_runtime_is_not_initialised():
    rt = runtime(initialised=False)
    with pytest.raises(BackendError, match="not initialised.*-FI_ENOSYS"):
        NeuronBackend(runtime=rt).prepare()
    assert "fi_getinfo" not in rt.events  # libfabric's once-per-process state is left alone


def test_prepare_needs_libfabric_and_an_api_1_18_libfabric():
    with pytest.raises(BackendError, match="cannot load libfabric.so.1"):
        NeuronBackend(runtime=runtime(fabric=None)).prepare()
    with pytest.raises(BackendError, match="libfabric 1.21 or later"):
        NeuronBackend(runtime=runtime(fabric=(1, 17))).prepare()


def test_real_runtime_reports_no_libfabric_as_none():
    assert NeuronRuntime(fabric_lib="libfabric-that-does-not-exist.so.9").efa_hmem() is None


def _real_libfabric() -> lf.Libfabric:
    try:
        return lf.Libfabric()
    except OSError:
        pytest.skip("libfabric.so.1 is not installed here")


def test_fi_getinfo_probe_against_a_real_libfabric():
    fabric = _real_libfabric()
    caps = lf.FI_MSG | lf.FI_RMA | lf.FI_LOCAL_COMM | lf.FI_REMOTE_COMM
    basic = lf.FI_MR_LOCAL | lf.FI_MR_ALLOCATED  # the mr_mode NIXL asks of tcp/sockets
    v = lf.fi_version(1, 17)  # what every packaged libfabric serves
    assert fabric.providers("no-such-provider", caps=caps, mr_mode=basic, api_version=v) == []
    found = {p: fabric.providers(p, caps=caps, mr_mode=basic, api_version=v)
             for p in ("tcp", "sockets", "udp")}
    named = [(p, names) for p, names in found.items() if names]
    assert named, "no tcp, sockets or udp provider in this libfabric"
    for p, names in named:  # read back through the struct offsets: the provider asked for
        assert all(n.split(";")[0] == p for n in names), (p, names)


def _c_strtol(value: str) -> int:
    libc = ctypes.CDLL(None)
    libc.strtol.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int]
    libc.strtol.restype = ctypes.c_long
    return libc.strtol(value.encode(), None, 0)


INTS = ["0", "1", "2", "-1", "+3", " 0", "  7x", "0x0", "0x1f", "010", "08", "0x", "",
        "false", "off", "no", "true", "yes", "on", "1e3"]


@pytest.mark.parametrize("value", INTS)
def test_fi_int_reads_like_strtol(value):
    assert lf.fi_int(value) == _c_strtol(value)


BOOLS = {"0": False, "false": False, "FALSE": False, "No": False, "off": False,
         "1": True, "true": True, "True": True, "YES": True, "on": True}
BAD_BOOLS = ["", "2", "enabled", " 1", "1 ", "y", "n", "0x1"]


def test_fi_bool_is_libfabrics_parser():
    for value, want in BOOLS.items():
        assert lf.fi_bool(value) is want, value
    for value in BAD_BOOLS:
        with pytest.raises(lf.LibfabricValueError):
            lf.fi_bool(value)
    assert lf.fi_bool(None) is None


def test_fi_bool_matches_a_real_libfabric(monkeypatch):
    fabric = _real_libfabric()
    fabric.providers("no-such-provider", caps=lf.FI_MSG, mr_mode=0,
                     api_version=lf.fi_version(1, 17))  # fi_ini defines the core parameters
    lib = ctypes.CDLL(lf.LIBFABRIC)
    lib.fi_param_get.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    lib.fi_param_get.restype = ctypes.c_int
    for value in [*BOOLS, *BAD_BOOLS]:
        monkeypatch.setenv("FI_FORK_UNSAFE", value)  # a core FI_PARAM_BOOL
        out = ctypes.c_int(-1)
        rc = lib.fi_param_get(None, b"fork_unsafe", ctypes.byref(out))
        if value in BOOLS:
            assert rc == 0 and bool(out.value) is BOOLS[value], value
        else:
            assert rc != 0, value


# -- 2. FI_EFA_USE_DEVICE_RDMA and FI_EFA_ENABLE_SHM_TRANSFER as libfabric reads them ----------


@pytest.mark.parametrize("value", [None, "0", "false", "No", "OFF"])
def test_prepare_requires_device_rdma(value):
    with pytest.raises(BackendError, match="set FI_EFA_USE_DEVICE_RDMA=1"):
        NeuronBackend(runtime=runtime(env={"FI_EFA_USE_DEVICE_RDMA": value})).prepare()


@pytest.mark.parametrize("value", ["1", "true", "YES", "On"])
def test_prepare_accepts_libfabrics_spellings_of_true(value):
    NeuronBackend(runtime=runtime(env={"FI_EFA_USE_DEVICE_RDMA": value})).prepare()


@pytest.mark.parametrize("value", ["2", "enabled", " 1"])
def test_prepare_refuses_a_device_rdma_value_libfabric_aborts_on(value):
    with pytest.raises(BackendError, match="not a libfabric boolean"):
        NeuronBackend(runtime=runtime(env={"FI_EFA_USE_DEVICE_RDMA": value})).prepare()


@pytest.mark.parametrize("value", ["0", "false", "off", "no", " 0", "0x0"])
def test_colocated_accepts_shm_transfer_off_in_libfabrics_spellings(value):
    rt = runtime(env={"FI_EFA_ENABLE_SHM_TRANSFER": value})
    NeuronBackend(runtime=rt).prepare(colocated=True)


@pytest.mark.parametrize("value", [None, "1", "2", "0x1"])
def test_colocated_refuses_shm_transfer_on(value):
    rt = runtime(env={"FI_EFA_ENABLE_SHM_TRANSFER": value})
    with pytest.raises(BackendError, match="FI_EFA_ENABLE_SHM_TRANSFER"):
        NeuronBackend(runtime=rt).prepare(colocated=True)


def test_colocated_warns_when_true_reads_as_zero(caplog):
    rt = runtime(env={"FI_EFA_ENABLE_SHM_TRANSFER": "true"})  # strtol("true") == 0: shm off
    with caplog.at_level(logging.WARNING):
        NeuronBackend(runtime=rt).prepare(colocated=True)
    assert "reads as 0" in caplog.text


# -- 3. the torch plugin the environment has ---------------------------------------------------


def _only(monkeypatch, *present: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name, *a, **kw):
        if name in nb.TORCH_PLUGINS:
            return SimpleNamespace(name=name) if name in present else None
        return real(name, *a, **kw)

    monkeypatch.setattr(nb.importlib.util, "find_spec", find_spec)


def test_torch_plugin_is_libtorch_neuronx_lite_in_the_sdk_2_32_environment(monkeypatch):
    _only(monkeypatch, "libtorch_neuronx_lite")
    assert NeuronRuntime.torch_plugin() == "libtorch_neuronx_lite"
    assert NeuronBackend.available()
    _only(monkeypatch, "torch_neuronx", "libtorch_neuronx_lite")
    assert NeuronRuntime.torch_plugin() == "torch_neuronx"
    _only(monkeypatch)
    assert NeuronRuntime.torch_plugin() is None


def test_hardware_test_skips_cleanly_without_a_device(monkeypatch):
    from test_backends import neuron_hardware_or_skip

    if os.path.exists("/dev/neuron0"):
        pytest.skip("this machine has a Neuron device")
    _only(monkeypatch, "libtorch_neuronx_lite")  # the package alone, no device: skip, not crash
    with pytest.raises(pytest.skip.Exception, match="torch-neuronx or libtorch_neuronx_lite"):
        neuron_hardware_or_skip()


# -- 4. NIXL versions: progress thread, handshake wait, supported pairs --------------------------


@pytest.mark.parametrize("ours, theirs, ok", [
    ("1.5.1", "1.5.1", True),
    ("1.5.1", "1.5.2", True),
    ("1.3.2", "1.3.2", True),
    ("", "", True),
    ("1.5.1", "1.3.2", False),  # SDK 2.32's NIXL against the one this project pins
    ("1.3.2", "1.4.0", False),
    ("1.4.0", "1.5.1", False),
    ("1.5.1", "", False),
    ("1.5.1", "garbage", False),
])
def test_check_peer_nixl(ours, theirs, ok):
    why = check_peer_nixl(ours, theirs)
    assert (why is None) is ok
    if not ok:
        assert "NIXL" in why and (theirs or "(unknown)") in why
    assert (check_peer_nixl(theirs, ours) is None) is ok  # both sides decide alike


def test_the_handshake_reason_names_the_libfabric_wait():
    assert "LIBFABRIC peer handshake" in check_peer_nixl("1.5.1", "1.3.2")
    assert "same major.minor" in check_peer_nixl("1.4.0", "1.5.1")


def test_libfabric_waits_for_handshake_from_1_4():
    assert not libfabric_waits_for_handshake("1.3.2")
    assert libfabric_waits_for_handshake("1.4.0") and libfabric_waits_for_handshake("1.5.1")
    assert libfabric_waits_for_handshake("")  # unknown: assume the wait


def test_neuron_backend_keeps_nixls_progress_thread_off():
    assert NeuronBackend.nixl_progress_thread is False


def test_protocol_2_carries_the_nixl_version():
    assert PROTOCOL_VERSION >= 2  # 2 added nixl_version; 3 (staged fields) kept it
    g = G.pooled(base=1 << 32, placement="kv_split", num_layers=1, num_kv_heads=2, head_size=8,
                 dtype_bytes=2, dtype="bfloat16", block_size=4, num_blocks=4)
    codec = Codec()
    hello = Hello(engine_id="d", agent_name="a", agent_metadata=b"m", geometry=g,
                  compat_hash="h", nixl_version="1.3.2")
    welcome = Welcome(engine_id="p", agent_name="b", agent_metadata=b"m", geometry=g,
                      compat_hash="h", side_channel_ports=(1,), nixl_version="1.5.1")
    assert codec.decode(codec.encode(hello)).nixl_version == "1.3.2"
    assert codec.decode(codec.encode(welcome)).nixl_version == "1.5.1"


GEOM = G.pooled(base=1 << 32, placement="kv_split", num_layers=2, num_kv_heads=2, head_size=8,
                dtype_bytes=2, dtype="bfloat16", block_size=4, num_blocks=8)


class RecordingTransport:
    """Just enough of ``Transport`` for the transfer thread; records every notification."""

    def __init__(self, name: str = "A", waits: bool = False):
        self.agent_name = name
        self.nixl_version = "1.5.1"
        self.first_call_waits_for_peer = waits
        self.sent: list[tuple[str, object]] = []
        self.inbox: list[tuple[str, bytes]] = []
        self.added: list[bytes] = []
        self.lock = threading.Lock()

    def register(self, regions, mem_type, dev_id):
        pass

    def metadata(self) -> bytes:
        return b"meta:" + self.agent_name.encode()

    def add_peer(self, metadata: bytes) -> str:
        self.added.append(metadata)
        return metadata[5:].decode()

    def remove_peer(self, peer: str) -> None:
        pass

    def send_notif(self, peer: str, data: bytes) -> bool:
        with self.lock:
            self.sent.append((peer, Codec().decode(data)))
        return True

    def get_notifs(self):
        with self.lock:
            out, self.inbox = self.inbox, []
        return out

    def poll(self, handle):
        return "DONE"

    def release(self, handle):
        pass

    def close(self):
        pass

    def sent_to(self, peer: str) -> list[str]:
        with self.lock:
            return [type(m).__name__ for p, m in self.sent if p == peer]


def _thread(transport, clock) -> TransferThread:
    return TransferThread(transport, engine_id="A", tp_rank=0, geometry=GEOM,
                          config=PushConfig(heartbeat_interval_s=4.0, idle_poll_s=0.001),
                          counters=Counters(), clock=clock)


def _sync(t: TransferThread) -> None:
    t.call(lambda: None, 10)
    t.call(lambda: None, 10)


def test_libfabric_transfer_thread_says_nothing_to_a_peer_it_has_not_heard_from():
    now = [0.0]
    tr = RecordingTransport(waits=True)
    t = _thread(tr, lambda: now[0])
    t.start()
    try:
        t.call(lambda: t.add_peer(b"meta:B", engine_id="B", tp_rank=0, geometry=GEOM,
                                  digest=geometry_digest(GEOM)), 10)
        for step in range(4):  # heartbeats fall due every second here
            now[0] += 1.0
            _sync(t)
        assert tr.sent_to("B") == []  # its first call would wait for B's NIXL handshake
        with tr.lock:
            tr.inbox.append(("B", Codec().encode(Heartbeat(engine_id="B", tp_rank=0, seq=1))))
        _sync(t)
        now[0] += 1.0
        _sync(t)
        assert "Heartbeat" in tr.sent_to("B")  # heard from: B loaded us, no wait
    finally:
        t.close()


class _SilenceRecorder:
    """A role that only records which peers the thread reported silent or dead."""

    handles = ()

    def __init__(self) -> None:
        self.silent: list[str] = []
        self.dead: list[str] = []

    def on_message(self, peer, msg) -> None:
        pass

    def tick(self, now: float) -> None:
        pass

    def busy(self) -> bool:
        return False

    def on_peer_silent(self, peer) -> None:
        self.silent.append(peer.agent_name)

    def on_peer_dead(self, peer) -> None:
        self.dead.append(peer.agent_name)

    def close(self) -> None:
        pass


def test_libfabric_transfer_thread_never_calls_a_silent_new_peer():
    """Silence is not death (the peer stays, marked unresponsive, until its lifeline closes), but
    over LIBFABRIC a peer never heard from is never called: not by heartbeats while it is silent,
    not when it is dropped, not by the goodbye on close."""
    now = [0.0]
    tr = RecordingTransport(waits=True)
    t = _thread(tr, lambda: now[0])
    role = _SilenceRecorder()
    t.add_role(role)
    t.start()
    try:
        t.call(lambda: t.add_peer(b"meta:C", engine_id="C", tp_rank=0, geometry=GEOM,
                                  digest=geometry_digest(GEOM)), 10)
        now[0] += 7.0  # past peer_timeout_s (6 s)
        _sync(t)
        assert t.call(lambda: (set(t.peers), t.peers["C"].silent), 10) == ({"C"}, True)
        assert role.silent == ["C"] and role.dead == []
        assert t.counters.get("peers_silent") == 1
        for _ in range(8):  # more heartbeat rounds while it stays silent: told once, never called
            now[0] += 1.0
            _sync(t)
        assert role.silent == ["C"]
        assert tr.sent_to("C") == []
        t.peer_lost("C", "producer closed its side channel")  # proof of death: dropped
        _sync(t)
        assert t.call(lambda: set(t.peers), 10) == set() and role.dead == ["C"]
        t.call(lambda: t.add_peer(b"meta:D", engine_id="D", tp_rank=0, geometry=GEOM,
                                  digest=geometry_digest(GEOM)), 10)
    finally:
        t.close()
    assert tr.sent_to("C") == [] and tr.sent_to("D") == []  # no goodbye, not even on close


def test_ucx_transfer_thread_still_heartbeats_a_new_peer_at_once():
    now = [0.0]
    tr = RecordingTransport(waits=False)
    t = _thread(tr, lambda: now[0])
    t.start()
    try:
        t.call(lambda: t.add_peer(b"meta:B", engine_id="B", tp_rank=0, geometry=GEOM,
                                  digest=geometry_digest(GEOM)), 10)
        now[0] += 1.0
        _sync(t)
        assert "Heartbeat" in tr.sent_to("B")
    finally:
        t.close()


def _producer(monkeypatch, ours: str):
    from kv_push.common import producer as producer_module

    tr = RecordingTransport("P")
    tr.nixl_version = ours
    t = _thread(tr, time.monotonic)
    return producer_module.Producer(t, on_released=lambda key: None), tr, t


def _hello(nixl_version: str) -> Hello:
    from kv_push.common.messages import COMPAT_HASH

    return Hello(engine_id="dec", agent_name="D", agent_metadata=b"meta:D", geometry=GEOM,
                 compat_hash=COMPAT_HASH, nixl_version=nixl_version)


def test_producer_refuses_a_decoder_on_an_incompatible_nixl(monkeypatch):
    producer, tr, t = _producer(monkeypatch, "1.5.1")
    with pytest.raises(MessageRejected, match="LIBFABRIC peer handshake") as e:
        producer.accept_hello(_hello("1.3.2"))
    assert e.value.reason == "incompatible"
    assert tr.added == []  # refused before its metadata was loaded
    welcome = producer.accept_hello(_hello("1.5.1"))
    assert welcome.nixl_version == "1.5.1" and tr.added == [b"meta:D"]


def test_decoder_refuses_a_producer_on_an_incompatible_nixl(monkeypatch):
    from kv_push.common import decoder as decoder_module
    from kv_push.common.messages import COMPAT_HASH

    tr = RecordingTransport("D")
    tr.nixl_version = "1.3.2"
    t = _thread(tr, time.monotonic)
    d = decoder_module.Decoder(t)
    try:
        assert d._my_hello().nixl_version == "1.3.2"
        remote = decoder_module._Remote(address=("p-host", 5600), connecting={0})
        welcome = Welcome(engine_id="pre", agent_name="P", agent_metadata=b"meta:P",
                          geometry=GEOM, compat_hash=COMPAT_HASH, side_channel_ports=(5600,),
                          nixl_version="1.5.1")
        token = next(d._tokens)  # what _connect does before its handshake job runs
        d._handshaking.add(token)
        severed: list[bool] = []
        d._on_welcome(remote, 0, welcome, token, lambda: severed.append(True))
        assert t.counters.get("rejected", label="incompatible") == 1
        assert t.counters.get("handshake_failures") == 1
        assert tr.added == []
        assert severed == [True]  # the refused producer's lifeline is not kept open
    finally:
        d.close()


# -- 5. models and placement ---------------------------------------------------------------------


@pytest.mark.parametrize("window", [128, 4096])
def test_sliding_window_models_are_refused(window):
    with pytest.raises(BackendError, match="sliding-window.*NeuronNixlConnector"):
        NeuronBackend(runtime=runtime()).check_model(sliding_window=window, tp_size=4)


def test_models_without_a_sliding_window_pass():
    for window in (None, 0):
        NeuronBackend(runtime=runtime()).check_model(sliding_window=window, tp_size=4)


@pytest.mark.parametrize("cores, tp, family, ok", [
    ("0-7", 8, TRN2, True),
    ("8-15", 8, TRN2, True),
    ("56-63", 8, TRN2, True),
    ("4-11", 8, TRN2, False),  # the right count at the wrong offset
    ("2-5", 4, TRN2, False),
    ("32-63", 8, TRN2, True),  # DP4 x TP8
    ("4-11", 8, TRN3, True),  # the rule is trn2's
    ("5", 1, TRN2, True),
    (None, 8, TRN2, True),  # all cores: starts at 0
])
def test_trn2_core_slice_must_start_at_a_multiple_of_tp(cores, tp, family, ok):
    rt = runtime(env={"NEURON_VISIBLE_DEVICES": cores}, family=family)
    backend = NeuronBackend(runtime=rt)
    if ok:
        backend.check_model(sliding_window=None, tp_size=tp)
    else:
        with pytest.raises(BackendError, match="not a multiple of the tensor-parallel size"):
            backend.check_model(sliding_window=None, tp_size=tp)


def test_misaligned_slice_on_an_unknown_instance_warns(caplog):
    rt = runtime(env={"NEURON_VISIBLE_DEVICES": "4-11"}, family=None)
    with caplog.at_level(logging.WARNING):
        NeuronBackend(runtime=rt).check_model(sliding_window=None, tp_size=8)
    assert "not a multiple of TP 8" in caplog.text


def test_core_slice_parsing():
    assert core_slice("0-3") == [0, 1, 2, 3]
    assert core_slice("8,9, 10-11") == [8, 9, 10, 11]
    assert core_slice(None) is None and core_slice(" ") is None
    with pytest.raises(BackendError, match="not a core list"):
        core_slice("0-x")


def test_connector_worker_refuses_a_sliding_window_model_at_start_up(monkeypatch):
    from kv_push.common import connector_worker, vllm_compat
    from kv_push.common.connector import KVPushConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    backend = NeuronBackend(runtime=runtime())
    monkeypatch.setattr(connector_worker, "select_backend", lambda name=None: backend)
    monkeypatch.setattr(vllm_compat, "tp_rank_and_size", lambda: (0, 4))
    monkeypatch.setattr(vllm_compat, "kv_dtype_name", lambda cfg: "bfloat16")

    def vllm_config(window):
        ktc = SimpleNamespace(kv_connector_extra_config={}, kv_role="kv_producer",
                              engine_id="e", is_kv_producer=True)
        mc = SimpleNamespace(get_total_num_kv_heads=lambda: 8, get_head_size=lambda: 64,
                             get_sliding_window=lambda: window)
        return SimpleNamespace(kv_transfer_config=ktc, model_config=mc,
                               cache_config=SimpleNamespace(block_size=32))

    with pytest.raises(BackendError, match="sliding-window attention \\(window 128\\)"):
        KVPushConnector(vllm_config(128), KVConnectorRole.WORKER, None)
    KVPushConnector(vllm_config(None), KVConnectorRole.WORKER, None)


# -- 7. packaging ----------------------------------------------------------------------------


def test_one_extra_per_platform_pinned():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for name in ("neuron", "cuda"):
        assert extras[name] and all("==" in req for req in extras[name]), (name, extras[name])
    neuron = {r.split("==")[0]: r.split("==")[1] for r in extras["neuron"]}
    assert {"vllm-neuron", "libtorch-neuronx-lite", "neuronx-cc", "nixl"} <= set(neuron)
    assert neuron["vllm-neuron"].startswith("0.24.") and neuron["libtorch-neuronx-lite"].startswith(
        "2.11.")  # vllm 0.24.0 pins torch 2.11.0
    cuda = {r.split("==")[0]: r.split("==")[1] for r in extras["cuda"]}
    tested = extras["nixl"][0].split("==")[1]
    assert cuda["nixl"] == cuda["nixl-cu12"] == cuda["nixl-cu13"] == tested
    readme = (ROOT / "README.md").read_text()
    assert "kv-push[neuron]" in readme and "kv-push[cuda]" in readme
    assert "pip.repos.neuron.amazonaws.com" in readme


# -- the staged path: not on Neuron (docs/neuron.md, "Staged and layer-wise transfers") ---------

DOC_SECTION = "docs/neuron.md, 'Staged and layer-wise transfers on Trainium'"


def _neuron_worker(rt: FakeNeuronRuntime, **config) -> PushWorker:
    backend = NeuronBackend(runtime=rt)
    layers = [rt.empty((2, 8, 2, 4, 8)) for _ in range(2)]
    geometry = describe_kv_caches(layers, backend=backend, num_kv_heads=2, head_size=8,
                                  block_size=4, tp_size=1, tp_rank=0, dtype="bfloat16")
    return PushWorker(geometry=geometry, role="both",
                      config=PushConfig(side_channel_port=0, **config), backend=backend,
                      transport_factory=lambda: FakeTransport(Wire(), "N")).start()


def test_neuron_backend_does_not_stage_and_says_where_that_is_explained():
    assert not hasattr(NeuronBackend, "alloc_staging")
    assert DOC_SECTION in NeuronBackend.staging_unsupported
    assert "Staged and layer-wise transfers on Trainium" in (ROOT / "docs/neuron.md").read_text()


def test_default_config_on_neuron_logs_the_region_path_once(caplog):
    with caplog.at_level(logging.INFO, logger="kv_push.common.worker"):
        worker = _neuron_worker(runtime())
    worker.close()
    assert worker.staging == {}
    told = [r.getMessage() for r in caplog.records if "staged transfers off" in r.getMessage()]
    assert len(told) == 1 and DOC_SECTION in told[0], told


def test_a_configured_pool_on_neuron_is_refused_with_the_doc_section():
    with pytest.raises(BackendError, match="Staged and layer-wise transfers on Trainium"):
        _neuron_worker(runtime(), decoder_staging_bytes=1 << 20)


def test_staged_off_on_neuron_says_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="kv_push.common.worker"):
        _neuron_worker(runtime(), staged="off").close()
    assert "staged transfers off" not in caplog.text
