"""Child-process server for ``bench_transfer.py``: a push worker plus a pull/bare NIXL agent.

``BenchPeerServer`` extends the demo's ``DemoPeerServer`` (a ``PeerServer`` with pattern
fill/verify and monotonic timestamps). Besides the ``PushWorker`` (the real push path) each
child owns a second NIXL agent (``AgentThread``: one thread owns it, as the transport contract
requires) over the same KV pool, used for

* **pull**, modelled on vLLM's NixlConnector: P's block ids reach D by one localhost HTTP
  request (P -> D's HTTP server; the router relay in production is at least this), D builds one
  descriptor per (layer, K/V, block) for both sides, posts a NIXL READ that carries a
  notification to P, polls it to completion; P learns it may free its blocks from that
  notification, polling for it every millisecond (vLLM's producer polls once per engine step);
* **bare WRITE**: the push plan's regions, descriptors and the transfer request built in
  advance; only post + poll to completion is timed (the lower bound for push);
* **bare READ**: the same for pull's per-block READ.

It also instruments the push path (no source changes: wrappers installed in this process) to
say where push time goes: ``Producer.prefill_done`` on the transfer thread, ``plan_writes``,
descriptor lists, ``initialize_xfer``, ``transfer``, the first DONE poll (P), and the
``WriteDone`` notice's arrival (D).

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

from kv_push.common import producer as producer_mod
from kv_push.common.demo import DemoPeerServer
from kv_push.common.geometry import KVGeometry
from kv_push.common.layout import plan_writes
from kv_push.common.messages import WriteDone
from kv_push.common.transport import NixlTransport


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
    """vLLM-NixlConnector-style pull over a second NIXL agent, shared by the CPU and GPU
    benchmark peers. The host class provides ``_pull_agent()`` (the ``AgentThread``),
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


class BenchPeerServer(PullPeer, DemoPeerServer):
    def __init__(self, spec):
        super().__init__(spec)
        self.agent = AgentThread(f"bench-{spec.role}-{self.worker.engine_id[:8]}")
        g = self.pool.geometry
        self.agent.call(lambda: self.agent.transport.register(g.regions(), g.mem_type, g.dev_id))
        self._pull_init()
        self._bare: dict[str, Any] = {}
        self.events: list[tuple] = []
        self._instrument()

    def _pull_agent(self) -> AgentThread:
        return self.agent

    def _pull_geometry(self) -> KVGeometry:
        return self.pool.geometry

    # -- push instrumentation --------------------------------------------------------------------
    def _instrument(self) -> None:
        ev = self.events
        clock = time.monotonic

        if self.worker.producer is not None:
            prod = self.worker.producer
            orig_pd = prod.prefill_done

            def prefill_done(*a, **k):
                ev.append(("thread_start", clock()))
                return orig_pd(*a, **k)

            prod.prefill_done = prefill_done

            def timed_plan(*a, **k):
                ev.append(("plan_start", clock()))
                out = plan_writes(*a, **k)
                ev.append(("plan_end", clock(), out.num_regions, out.unmerged))
                return out

            producer_mod.plan_writes = timed_plan
            agent = self.worker.thread.transport._agent
            orig = {n: getattr(agent, n) for n in
                    ("get_xfer_descs", "initialize_xfer", "transfer", "check_xfer_state")}

            def get_xfer_descs(*a, **k):
                ev.append(("descs_start", clock()))
                out = orig["get_xfer_descs"](*a, **k)
                ev.append(("descs_end", clock()))
                return out

            def initialize_xfer(*a, **k):
                ev.append(("init_start", clock()))
                out = orig["initialize_xfer"](*a, **k)
                ev.append(("init_end", clock()))
                return out

            def transfer(*a, **k):
                ev.append(("post_start", clock()))
                out = orig["transfer"](*a, **k)
                ev.append(("post_end", clock(), out))
                return out

            def check_xfer_state(*a, **k):
                out = orig["check_xfer_state"](*a, **k)
                ev.append(("poll", clock(), out))
                return out

            agent.get_xfer_descs = get_xfer_descs
            agent.initialize_xfer = initialize_xfer
            agent.transfer = transfer
            agent.check_xfer_state = check_xfer_state

        if self.worker.decoder is not None:
            cons = self.worker.decoder
            orig_msg = cons.on_message

            def on_message(peer, msg):
                if isinstance(msg, WriteDone):
                    ev.append(("writedone", clock()))
                return orig_msg(peer, msg)

            cons.on_message = on_message

    def take_events(self) -> dict:
        """Summarise (and clear) the push events recorded since the last call."""
        n = len(self.events)
        ev = self.events[:n]
        del self.events[:n]
        out: dict[str, Any] = {}
        polls = 0
        for e in ev:
            name, t = e[0], e[1]
            if name == "poll":
                polls += 1
                if e[2] != "PROC" and "done" not in out:
                    out["done"] = t
                continue
            if name == "post_end":
                out["post_state"] = e[2]
            if name == "plan_end":
                out["regions"], out["unmerged"] = e[2], e[3]
            out.setdefault(name, t)
            if name in ("descs_end",):
                out[name] = t  # the last of the two lists
        out["polls"] = polls
        return out

    # -- the second agent (pull methods come from PullPeer) ------------------------------
    def progress(self, on: bool) -> None:
        """Keep this agent polled (the target side of a bare transfer), as the push path does."""
        self._progress = on
        if on:
            self.agent.poll_interval = 0.0  # spin: the best case for the bare transfers
            self.agent.call(self._ensure_watch)

    def decoder_spin(self, on: bool) -> None:
        """Experiment: with ``on=False`` the decoder's transfer thread no longer spins while it
        only waits for ``WriteDone`` (it polls every ``idle_poll_s`` instead)."""
        cons = self.worker.decoder
        if on:
            cons.__dict__.pop("busy", None)
        else:
            cons.busy = lambda: any(w.state == "fencing" for w in cons.wants.values())

    # -- bare transfers --------------------------------------------------------------------------
    def _runner(self, via: str):
        """(call, transport, peer): run on the pull agent's thread, or on the push worker's
        transfer thread with its agent and its one peer (to compare the two agents)."""
        if via == "push":
            th = self.worker.thread
            peer = next(iter(th.peers))
            return (lambda fn: th.call(fn, 300.0)), th.transport, peer
        return self.agent.call, self.agent.transport, self.remote_peer

    def bare_prepare(self, op: str, src_blocks, dst_blocks, num_tokens: int, notif: bytes = b"",
                     via: str = "pull") -> dict:
        """Build the request in advance. WRITE (on P): the push plan's regions. READ (on D):
        pull's per-block descriptors. Returns descriptor count and build times."""
        call, t, peer = self._runner(via)

        def build():
            t0 = time.monotonic()
            if op == "WRITE":
                plan = plan_writes(self.pool.geometry, src_blocks, self.remote_geo, dst_blocks,
                                   first_token=0, num_tokens=num_tokens)
                local = plan.descs("src", self.pool.geometry.dev_id)
                remote = plan.descs("dst", self.remote_geo.dev_id)
            else:  # READ on D: local = D's blocks, remote = P's blocks
                remote = block_descs(self.remote_geo, src_blocks, num_tokens)
                local = block_descs(self.pool.geometry, dst_blocks, num_tokens)
            t1 = time.monotonic()
            ag = t._agent
            ld = ag.get_xfer_descs(local, "DRAM")
            rd = ag.get_xfer_descs(remote, "DRAM")
            t2 = time.monotonic()
            handle = ag.initialize_xfer(op, ld, rd, peer, notif)
            t3 = time.monotonic()
            self._bare[op] = (handle, via)
            return {"descs": int(local.shape[0]), "plan_s": t1 - t0, "dlist_s": t2 - t1,
                    "init_s": t3 - t2}
        return call(build)

    def bare_run(self, op: str) -> dict:
        """Post the prepared request and poll it to completion (on the thread that built it)."""
        handle, via = self._bare[op]
        call, t, _ = self._runner(via)

        def run():
            ag = t._agent
            t0 = time.monotonic()
            state = ag.transfer(handle)
            t1 = time.monotonic()
            while state == "PROC":
                state = ag.check_xfer_state(handle)
            t2 = time.monotonic()
            return {"start": t0, "posted": t1, "done": t2, "state": state}
        return call(run)

    def bare_release(self, op: str) -> None:
        handle, via = self._bare.pop(op, (None, None))
        if handle is not None:
            call, t, _ = self._runner(via)
            call(lambda: t._agent.release_xfer_handle(handle))

    # -- engine hand-off cost ----------------------------------------------------------------------
    def handoff_cost(self, what: str, n: int, num_blocks: int, address=None, batch: int = 50,
                     step_s: float = 0.005) -> dict:
        """Time ``n`` calls of ``prefill_done`` (P) or ``expect`` (D) on this (engine) thread,
        ``batch`` calls per simulated engine step of ``step_s`` (the transfer thread runs in
        between, as it would). Transfer ids never pair (P and D use disjoint ids), so no
        transfer starts; the producer's short rendezvous time-out keeps the backlog small."""
        ids = list(range(1000, 1000 + num_blocks))  # ints a real block table holds (> 256)
        tokens = num_blocks * self.pool.geometry.block_size
        out = np.empty(n, dtype=np.int64)
        pc = time.perf_counter_ns
        w = self.worker
        tag = f"{num_blocks}-{time.monotonic_ns()}"  # fresh keys: no call supersedes another
        addr = tuple(address) if address is not None else None
        for i in range(n):
            if i and i % batch == 0:
                time.sleep(step_s)
            t = pc()
            if what == "prefill_done":
                w.prefill_done(f"hp-{tag}-{i}", f"hand-p-{tag}-{i}", ids, tokens)
            else:
                w.expect(f"hd-{tag}-{i}", f"hand-d-{tag}-{i}", 0, addr, ids, 0, tokens)
            out[i] = pc() - t
        us = out / 1e3
        return {"calls": n, "block_ids": num_blocks, "median_us": float(np.median(us)),
                "p99_us": float(np.percentile(us, 99)), "mean_us": float(us.mean()),
                "max_us": float(us.max()), "batch": batch, "step_s": step_s}

    def close(self):
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._client is not None:
            self._client.close()
        self.agent.close()
        return super().close()
