"""``BenchPeerServer``: the benchmarks' peer server -- push, pull and bare NIXL transfers.

A ``PeerServer`` (a ``PushWorker``, the real push path, over any memory: a host pool for
``benchmarks/bench_transfer.py``, torch tensors on a GPU for ``bench_transfer_gpu.py``) plus a
second NIXL agent (``pull_peer.AgentThread``, created on first use) over the same KV memory, used
for

* **pull**, modelled on vLLM's NixlConnector (``pull_peer.PullPeer``): P's block ids reach D by
  one localhost HTTP request, D posts a per-block NIXL READ that notifies P; P polls for that
  notification every millisecond (vLLM's producer polls once per engine step);
* **bare WRITE**: the push plan's regions, descriptors and the transfer request built in
  advance; only post + poll to completion is timed (the lower bound for push);
* **bare READ**: the same for pull's per-block READ.

``instrument()`` wraps the push path (no source changes: wrappers installed in this process) to
say where push time goes: ``Producer.prefill_done`` on the transfer thread, ``plan_writes``,
descriptor lists, ``initialize_xfer``, ``transfer``, the first DONE poll (P), and the
``WriteDone`` notice's arrival (D); ``take_events`` summarises them.

Every timestamp is ``time.monotonic()`` in the child, which is one clock for all processes.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .. import producer as producer_mod
from ..geometry import KVGeometry
from ..layout import plan_writes
from ..messages import WriteDone
from .peer_server import PeerServer
from .pull_peer import AgentThread, PullPeer, block_descs

SERVER = f"{__name__}:BenchPeerServer"  # for LocalPeer / start_pair


class BenchPeerServer(PullPeer, PeerServer):
    """Public methods (and the memory's) are the commands; see the module docstring."""

    def __init__(self, spec):
        super().__init__(spec)
        self.agent: AgentThread | None = None  # the pull / bare agent, created on first use
        self._pull_init()
        self._bare: dict[str, Any] = {}
        self.events: list[tuple] = []
        self._instrumented = False

    def _pull_agent(self) -> AgentThread:
        if self.agent is None:
            g = self.memory.geometry
            agent = AgentThread(f"bench-{self.spec.role}-{self.worker.engine_id[:8]}")
            agent.call(lambda: agent.transport.register(g.regions(), g.mem_type, g.dev_id))
            self.agent = agent
        return self.agent

    def _pull_geometry(self) -> KVGeometry:
        return self.memory.geometry

    # -- push instrumentation --------------------------------------------------------------------
    def instrument(self) -> None:
        """Record push-path events (see the module docstring) from now on; idempotent."""
        if self._instrumented:
            return
        self._instrumented = True
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
            agent = self._pull_agent()
            agent.poll_interval = 0.0  # spin: the best case for the bare transfers
            agent.call(self._ensure_watch)

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
        agent = self._pull_agent()
        return agent.call, agent.transport, self.remote_peer

    def bare_prepare(self, op: str, src_blocks, dst_blocks, num_tokens: int, notif: bytes = b"",
                     via: str = "pull") -> dict:
        """Build the request in advance. WRITE (on P): the push plan's regions. READ (on D):
        pull's per-block descriptors. Returns descriptor count and build times."""
        call, t, peer = self._runner(via)
        g, rg = self.memory.geometry, self.remote_geo

        def build():
            t0 = time.monotonic()
            if op == "WRITE":
                plan = plan_writes(g, src_blocks, rg, dst_blocks, first_token=0,
                                   num_tokens=num_tokens)
                local, remote = plan.descs("src", g.dev_id), plan.descs("dst", rg.dev_id)
            else:  # READ on D: local = D's blocks, remote = P's blocks
                remote = block_descs(rg, src_blocks, num_tokens)
                local = block_descs(g, dst_blocks, num_tokens)
            t1 = time.monotonic()
            ag = t._agent
            ld = ag.get_xfer_descs(local, g.mem_type)
            rd = ag.get_xfer_descs(remote, rg.mem_type)
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
        tokens = num_blocks * self.memory.geometry.block_size
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
        if self.agent is not None:
            self.agent.close()
        return super().close()
