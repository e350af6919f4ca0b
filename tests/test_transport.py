"""The transport seam: ``NixlTransport`` honours the failure model its protocol documents.

A stand-in NIXL agent is injected (through ``transport._nixl_api``) whose every call can be made
to raise, so each method's failure path runs without NIXL: set-up and handshake steps raise
``TransportError``; everything on the transfer path returns a value and never raises.
"""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest

from kv_push.common import transport as transport_mod
from kv_push.common.transport import NixlTransport, Transport, TransportError


class StandInAgent:
    """The part of ``nixl._api.nixl_agent`` that ``NixlTransport`` calls. ``fail`` names the
    methods that raise; ``states`` is what ``transfer`` / ``check_xfer_state`` return."""

    fail: set[str] = set()
    made: list["StandInAgent"] = []

    def __init__(self, name, config):
        type(self).made.append(self)
        self.name = name
        self.backends = {b: object() for b in config.backends if b != "MISSING"}
        self.released: list[object] = []
        self.removed: list[str] = []
        self.notifs: dict = {}
        self.transfer_state = "PROC"
        self.xfer_state = "DONE"

    def _maybe_fail(self, what: str) -> None:
        if what in self.fail:
            raise RuntimeError(f"{what} broke")

    def get_plugin_list(self):
        return ["UCX"]

    def register_memory(self, descs, mem_type):
        self._maybe_fail("register_memory")
        return ("reg", mem_type, tuple(descs))

    def deregister_memory(self, reg):
        self._maybe_fail("deregister_memory")

    def get_agent_metadata(self):
        self._maybe_fail("get_agent_metadata")
        return b"meta:" + self.name.encode()

    def add_remote_agent(self, metadata):
        self._maybe_fail("add_remote_agent")
        return metadata[5:]  # the bindings hand back bytes

    def remove_remote_agent(self, peer):
        self._maybe_fail("remove_remote_agent")
        self.removed.append(peer)

    def get_xfer_descs(self, descs, mem_type):
        self._maybe_fail("get_xfer_descs")
        return (mem_type, descs.shape)

    def initialize_xfer(self, op, local, remote, peer, notif):
        self._maybe_fail("initialize_xfer")
        return ("xfer", op, peer, notif)

    def transfer(self, handle):
        self._maybe_fail("transfer")
        return self.transfer_state

    def check_xfer_state(self, handle):
        self._maybe_fail("check_xfer_state")
        return self.xfer_state

    def release_xfer_handle(self, handle):
        self._maybe_fail("release_xfer_handle")
        self.released.append(handle)

    def send_notif(self, peer, data):
        self._maybe_fail("send_notif")

    def get_new_notifs(self):
        self._maybe_fail("get_new_notifs")
        notifs, self.notifs = self.notifs, {}
        return notifs


class StandInConfig:
    def __init__(self, enable_prog_thread, backends):
        self.backends = backends


@pytest.fixture
def make(monkeypatch):
    """A ``NixlTransport`` over a ``StandInAgent``, and that agent; ``fail`` as there."""

    def build(*fail: str, backends=("UCX",)) -> tuple[NixlTransport, StandInAgent]:
        agent_cls = type("Agent", (StandInAgent,), {"fail": set(fail), "made": []})
        monkeypatch.setattr(transport_mod, "_nixl_api", lambda: (agent_cls, StandInConfig))
        t = NixlTransport(name="me", backends=backends)
        (agent,) = agent_cls.made
        return t, agent

    return build


DESCS = np.array([[0x1000, 64, 0]], dtype=np.uint64)


def protocol_methods() -> list[str]:
    return [n for n, v in vars(Transport).items() if not n.startswith("_") and callable(v)]


def test_every_protocol_method_is_documented_and_implemented():
    methods = protocol_methods()
    assert {"write", "poll", "failure_reason", "release", "get_notifs", "metadata"} <= set(methods)
    for name in methods:
        doc = inspect.getdoc(getattr(Transport, name)) or ""
        params = [p for p in inspect.signature(getattr(Transport, name)).parameters if p != "self"]
        for p in params:  # every argument is described
            assert f"{p}:" in doc, f"Transport.{name} does not describe {p}"
        assert "Returns:" in doc or "Raises:" in doc or "never raises" in doc, name
        assert callable(getattr(NixlTransport, name, None)), f"NixlTransport lacks {name}"


def test_setup_failures_raise_transport_error(make):
    with pytest.raises(TransportError, match="did not load"):
        make(backends=("UCX", "MISSING"))
    with pytest.raises(TransportError, match="registering 1 DRAM"):
        make("register_memory")[0].register([(0x1000, 64)], "DRAM", 0)
    with pytest.raises(TransportError, match="metadata"):
        make("get_agent_metadata")[0].metadata()
    with pytest.raises(TransportError, match="peer's NIXL metadata"):
        make("add_remote_agent")[0].add_peer(b"meta:you")


def test_handshake_round_trip_names_the_peer(make):
    t, _ = make()
    assert t.metadata() == b"meta:me"
    assert t.add_peer(b"meta:you") == "you"  # bytes from the bindings become str


@pytest.mark.parametrize("broken, reason", [
    ("get_xfer_descs", "preparing WRITE to you"),
    ("initialize_xfer", "preparing WRITE to you"),
    ("transfer", "posting WRITE to you"),
])
def test_a_write_that_cannot_be_posted_is_a_failed_handle(make, broken, reason):
    t, _ = make(broken, "release_xfer_handle")  # releasing the half-made handle fails too
    t.add_peer(b"meta:you")
    h = t.write("you", DESCS, DESCS, "DRAM", "DRAM", b"n")
    assert t.poll(h) == "ERR"
    assert reason in t.failure_reason(h)
    t.release(h)  # a no-op for a handle that never existed


def test_write_to_an_unknown_peer_and_a_refused_post_are_failed_handles(make):
    t, agent = make()
    h = t.write("stranger", DESCS, DESCS, "DRAM", "DRAM", b"n")
    assert t.poll(h) == "ERR" and "unknown peer stranger" in t.failure_reason(h)
    t.add_peer(b"meta:you")
    agent.transfer_state = "ERR"
    h = t.write("you", DESCS, DESCS, "DRAM", "DRAM", b"n")
    assert t.poll(h) == "ERR" and "returned ERR" in t.failure_reason(h)
    assert len(agent.released) == 1  # the refused handle was given back at once


def test_transfer_path_failures_are_values(make, caplog):
    t, _ = make("check_xfer_state", "release_xfer_handle", "send_notif", "get_new_notifs",
             "remove_remote_agent", "deregister_memory")
    t.register([(0x1000, 64)], "DRAM", 0)
    t.add_peer(b"meta:you")
    h = t.write("you", DESCS, DESCS, "DRAM", "DRAM", b"n")
    assert t.poll(h) == "ERR"
    assert t.failure_reason(h)
    t.release(h)
    assert t.send_notif("you", b"x") is False
    assert t.send_notif("stranger", b"x") is False
    with caplog.at_level(logging.WARNING, logger=transport_mod.__name__):
        assert t.get_notifs() == [] and t.get_notifs() == []
    # polled in a loop: the same error is logged once
    assert sum("notifications failed" in r.getMessage() for r in caplog.records) == 1
    t.remove_peer("you")
    t.remove_peer("stranger")
    t.close()


def test_get_notifs_flattens_senders(make):
    t, agent = make()
    agent.notifs = {b"you": [b"a", b"b"], "other": [b"c"]}
    assert t.get_notifs() == [("you", b"a"), ("you", b"b"), ("other", b"c")]
    assert t.get_notifs() == []
