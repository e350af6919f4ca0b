"""vLLM-NixlConnector-style pull over a second NIXL agent, for the benchmarks' baselines.

* ``AgentThread``: one thread owning one ``NixlTransport`` (as the transport contract requires),
  running submitted callables and pollers;
* ``block_descs``: vLLM-style descriptors, one per (layer, K/V, block), whole blocks;
* ``PullPeer``: a mixin for a peer server. P's block ids reach D by one localhost HTTP request
  (P -> D's HTTP server; the router relay in production is at least this), D builds one
  descriptor per (layer, K/V, block) for both sides and posts a NIXL READ that carries a
  notification to P, polls it to completion; P learns it may free its blocks from that
  notification.

Every timestamp is ``time.monotonic()`` in the child, which is one clock for all processes.
"""

from __future__ import annotations

import http.client
import json
import queue
import socket
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Callable

import numpy as np

from ..geometry import KVGeometry
from ..transport import NixlTransport


class AgentThread:
    """One thread owning one ``NixlTransport``: runs submitted callables, and runs its pollers
    (callables returning True when finished) while any are active: spinning when
    ``poll_interval`` is 0, else every ``poll_interval`` seconds."""

    def __init__(self, name: str):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pollers: list[Callable[[], bool]] = []
        self.poll_interval = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.transport: NixlTransport = self.call(lambda: NixlTransport(name=name))

    def submit(self, fn: Callable[[], Any]) -> None:
        self._inbox.put((fn, None))

    def call(self, fn: Callable[[], Any], timeout: float = 120.0) -> Any:
        fut: Future = Future()
        self._inbox.put((fn, fut))
        return fut.result(timeout)

    def add_poller(self, fn: Callable[[], bool]) -> None:  # on this thread only
        self._pollers.append(fn)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._pollers:
                    item = self._inbox.get(timeout=0.2)
                elif self.poll_interval > 0:
                    item = self._inbox.get(timeout=self.poll_interval)
                else:
                    item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                fn, fut = item
                try:
                    result = fn()
                    if fut is not None:
                        fut.set_result(result)
                except BaseException as e:  # noqa: BLE001 - handed back to the caller
                    if fut is not None:
                        fut.set_exception(e)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            if self._pollers:
                self._pollers = [p for p in self._pollers if not p()]
                if self._pollers and self.poll_interval <= 0:
                    time.sleep(0)  # as the transfer thread does while busy

    def close(self) -> None:
        def shut():
            self._pollers.clear()
            self.transport.close()
        try:
            self.call(shut, timeout=10)
        except Exception:  # noqa: BLE001
            pass
        self._stop.set()
        self._thread.join(5)


def block_descs(geo: KVGeometry, block_ids, num_tokens: int) -> np.ndarray:
    """vLLM-style descriptors: one per (layer, K/V, block) -- region-major, whole blocks."""
    n = -(-num_tokens // geo.block_size)
    ids = np.asarray(list(block_ids)[:n], dtype=np.int64)
    bases = np.array([b for part in zip(*geo.part_bases) for b in part], dtype=np.int64)
    addr = (bases[:, None] + ids[None, :] * geo.block_stride).ravel()
    out = np.empty((addr.shape[0], 3), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = geo.block_bytes
    out[:, 2] = geo.dev_id
    return out


class _PullHTTP(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_POST(self):  # noqa: N802
        t = time.monotonic()
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.owner._on_pull_request(json.loads(body), t)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):  # quiet
        pass


class PullPeer:
    """vLLM-NixlConnector-style pull over a second NIXL agent (a mixin for a peer server).
    The host class provides ``_pull_agent()`` (the ``AgentThread``),
    ``_pull_geometry()`` (its own KV geometry), and calls ``_pull_init()`` in its constructor.
    P side: ``pull_prefill_done`` relays the block ids to D over HTTP, ``pull_notif_at`` waits for
    D's completion notice. D side: ``http_port``, ``pull_expect``, ``pull_result``."""

    def _pull_init(self) -> None:
        self._cond = getattr(self, "_cond", None) or threading.Condition()
        self.remote_peer: str | None = None
        self.remote_geo: KVGeometry | None = None
        self._http: HTTPServer | None = None
        self._client: http.client.HTTPConnection | None = None
        self._pull_dst: dict[str, list[int]] = {}
        self._pull_res: dict[str, dict] = {}
        self._notif_at: dict[bytes, float] = {}
        self._watching = False  # a pull is in flight (P waits for D's notice)
        self._progress = False  # keep the agent polled (target of a bare transfer)
        self._watch_on = False

    def pull_agent_metadata(self) -> bytes:
        a = self._pull_agent()
        return a.call(a.transport.metadata)

    def pull_add_peer(self, metadata: bytes, geometry: KVGeometry) -> str:
        a = self._pull_agent()
        self.remote_geo = geometry
        self.remote_peer = a.call(lambda: a.transport.add_peer(metadata))
        return self.remote_peer

    def _ensure_watch(self) -> None:  # on the agent thread
        """Poll notifications (P: pull completions), stamping them, while watched."""
        if self._watch_on:
            return
        self._watch_on = True
        t = self._pull_agent().transport

        def poller() -> bool:
            for _, msg in t.get_notifs():
                with self._cond:
                    self._notif_at[bytes(msg)] = time.monotonic()
                    self._cond.notify_all()
            if self._watching or self._progress:
                return False
            self._watch_on = False
            return True

        self._pull_agent().add_poller(poller)

    # -- P side ----------------------------------------------------------------------------------
    def pull_prefill_done(self, key: str, block_ids, num_tokens: int, d_port: int,
                          poll_s: float = 0.001) -> float:
        """Relay the block ids to D, then watch for D's notification, polling every ``poll_s``
        (vLLM's producer checks once per engine step; 0 = spin)."""
        ids = [int(b) for b in block_ids]
        t0 = time.monotonic()
        agent = self._pull_agent()
        agent.poll_interval = poll_s
        self._watching = True
        agent.submit(self._ensure_watch)
        if self._client is None:
            self._client = http.client.HTTPConnection("127.0.0.1", d_port, timeout=60)
            self._client.connect()
            self._client.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        body = json.dumps({"key": key, "block_ids": ids, "num_tokens": num_tokens}).encode()
        self._client.request("POST", "/pull", body, {"Content-Type": "application/json"})
        resp = self._client.getresponse()
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"relay answered {resp.status}")
        return t0

    def pull_notif_at(self, key: str, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        k = key.encode()
        with self._cond:
            while k not in self._notif_at:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            t = self._notif_at.pop(k, None)
        self._watching = False
        return t

    # -- D side ----------------------------------------------------------------------------------
    def http_port(self) -> int:
        if self._http is None:
            self._http = HTTPServer(("127.0.0.1", 0), _PullHTTP)
            self._http.owner = self  # type: ignore[attr-defined]
            threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.2},
                             name="pull-relay", daemon=True).start()
        return self._http.server_address[1]

    def pull_expect(self, key: str, block_ids) -> None:
        self._pull_dst[key] = [int(b) for b in block_ids]

    def _on_pull_request(self, req: dict, t_http: float) -> None:  # HTTP thread
        self._pull_agent().submit(lambda: self._pull_start(req, t_http))

    def _pull_start(self, req: dict, t_http: float) -> None:  # agent thread
        key = req["key"]
        t_start = time.monotonic()
        agent = self._pull_agent()
        t = agent.transport
        g, rg = self._pull_geometry(), self.remote_geo
        remote = block_descs(rg, req["block_ids"], req["num_tokens"])
        local = block_descs(g, self._pull_dst.pop(key), req["num_tokens"])
        t_desc = time.monotonic()
        handle = t.read(self.remote_peer, local, remote, g.mem_type, rg.mem_type, key.encode())
        t_post = time.monotonic()
        res = {"http": t_http, "start": t_start, "desc": t_desc, "post": t_post,
               "descs": int(local.shape[0])}

        def poller() -> bool:
            state = t.poll(handle)
            if state == "PROC":
                return False
            res["done"] = time.monotonic()
            res["state"] = state
            if state == "ERR":
                res["reason"] = t.failure_reason(handle)
            t.release(handle)
            with self._cond:
                self._pull_res[key] = res
                self._cond.notify_all()
            return True

        if not poller():
            agent.add_poller(poller)

    def pull_result(self, key: str, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._pull_res:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._pull_res.pop(key)
