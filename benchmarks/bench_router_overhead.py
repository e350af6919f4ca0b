#!/usr/bin/env python3
"""What the router adds to a request's TTFT, without vLLM (issue 12 item 4).

Two instant fake upstreams in one raw-asyncio process (no web framework: a P that answers the
one-token JSON, a D that streams four SSE chunks) on core 1, the real ``kv-push-router``
(push mode) on core 0, the client floating. Two measurements, both written to ``--out``:

* ``hop``: a streaming completion straight to the fake D vs through the router (TTFT at the
  client: first ``data:`` line), alternating, ``--requests`` each; the difference is what the
  router's two HTTP hops and its dispatch cost;
* ``clients``: the router's leg pattern (P's POST read whole, D's streaming POST to its first
  chunk, concurrently) with an httpx ``AsyncClient``, an aiohttp ``ClientSession`` and one with
  ``trust_env=True`` on one uvloop, ``--requests`` pairs each, alternating: why the legs use
  aiohttp (``common/router/app.py``, ``LegResponse``), without ``trust_env`` (it reads
  ``~/.netrc`` and the proxy variables in worker threads for every request).

Usage::

    .venv/bin/python benchmarks/bench_router_overhead.py          # ~1 min
    # idle between requests, token-id prompts (as bench_serving.py's concurrency-1 point)
    .venv/bin/python benchmarks/bench_router_overhead.py --gap-s 0.01 --prompt-tokens 512
    # against an earlier commit's router, alternating on the same fakes
    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/bench_router_overhead.py --baseline /tmp/base --out ...

Each router's CPU time per request it served (``cpu_ms_per_request``, from ``/proc``) is
written beside its TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_meta import checkout_env, source_commit

REPO = Path(__file__).resolve().parents[1]

_CHUNK = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m"}
SSE = b"".join(
    b"data: " + json.dumps(dict(_CHUNK, choices=[{"index": 0, "text": f"t{i} ",
                                                   "finish_reason": None if i < 3 else "length"}]
                                )).encode() + b"\n\n" for i in range(4)) + b"data: [DONE]\n\n"
P_JSON = json.dumps(dict(_CHUNK, choices=[{"index": 0, "text": "t0 ", "finish_reason": "length"}],
                         kv_transfer_params={"transfer_mode": "push"})).encode()


async def _serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, role: str):
    try:
        while True:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            lines = head.split("\r\n")
            length = next((int(h.split(":", 1)[1]) for h in lines[1:]
                           if h.lower().startswith("content-length:")), 0)
            body = await reader.readexactly(length) if length else b""
            if lines[0].split()[1].startswith("/health"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            elif role == "p" and b'"stream": true' not in body and b'"stream":true' not in body:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n" % len(P_JSON) + P_JSON)
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n"
                             + b"%x\r\n" % len(SSE) + SSE + b"\r\n0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _fakes() -> None:
    p = await asyncio.start_server(lambda r, w: _serve_one(r, w, "p"), "127.0.0.1", 0)
    d = await asyncio.start_server(lambda r, w: _serve_one(r, w, "d"), "127.0.0.1", 0)
    print(f"http://127.0.0.1:{p.sockets[0].getsockname()[1]}",
          f"http://127.0.0.1:{d.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def _stats(v: list[float]) -> dict:
    v = sorted(v)
    return {"n": len(v), "p50_ms": statistics.median(v), "p90_ms": v[int(len(v) * 0.9)],
            "min_ms": v[0]}


def _cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds so far (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_router(p_url: str, d_url: str, source: str | None) -> tuple[subprocess.Popen, str]:
    """The router on core 0; ``source``: a checkout whose router runs instead of this one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = checkout_env(source)
    router = subprocess.Popen(
        ["taskset", "-c", "0", sys.executable, "-m", "kv_push.common.router", "--port",
         str(port), "--mode", "push", "--prefill", f"{p_url},kv=127.0.0.1:9", "--decode", d_url,
         "--log-level", "warning"], cwd="/", env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return router, f"http://127.0.0.1:{port}"


def hop(p_url: str, d_url: str, n: int, gap_s: float = 0.0, prompt_tokens: int = 0,
        baseline: str | None = None) -> dict:
    """Streaming TTFT straight to D, through the router and (``baseline``: a checkout) through
    that checkout's router, alternating; each router's CPU time per request it served."""
    import httpx
    routers = {"router": _start_router(p_url, d_url, None)}
    if baseline:
        routers["baseline_router"] = _start_router(p_url, d_url, baseline)
    try:
        client = httpx.Client(timeout=30)
        for _, r_url in routers.values():
            for _ in range(100):
                try:
                    if client.get(r_url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        # a token-id list as the benchmarks send (--prompt-tokens), else a 300-word string
        prompt = list(range(10, 10 + prompt_tokens)) if prompt_tokens else "hello " * 300
        body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "stream": True}

        def ttft(url: str) -> float:
            t = time.perf_counter()
            first = None
            with client.stream("POST", url + "/v1/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if first is None and line.startswith("data: {"):
                        first = (time.perf_counter() - t) * 1000
            assert first is not None, "no chunk streamed"
            return first

        for _ in range(20):
            ttft(d_url)
            for _, r_url in routers.values():
                ttft(r_url)
        times: dict[str, list[float]] = {"direct": [], **{k: [] for k in routers}}
        cpu0 = {k: _cpu_s(proc.pid) for k, (proc, _) in routers.items()}
        order = ["direct", *routers]
        urls = {"direct": d_url, **{k: u for k, (_, u) in routers.items()}}
        for i in range(n):
            for k in order[i % len(order):] + order[:i % len(order)]:  # rotating order
                times[k].append(ttft(urls[k]))
                time.sleep(gap_s)
        out: dict = {k: _stats(v) for k, v in times.items()}
        for k, (proc, _) in routers.items():
            out[k]["cpu_ms_per_request"] = (_cpu_s(proc.pid) - cpu0[k]) / n * 1000
            out[k]["added_p50_ms"] = out[k]["p50_ms"] - out["direct"]["p50_ms"]
        out["added_p50_ms"] = out["router"]["added_p50_ms"]
        if baseline:
            out["baseline"] = baseline
        return out
    finally:
        for proc, _ in routers.values():  # a graceful stop first (a profiler's atexit runs)
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def clients(p_url: str, d_url: str, n: int) -> dict:
    import aiohttp
    import httpx
    import uvloop
    body = {"model": "m", "prompt": "hello " * 300, "max_tokens": 1, "stream": False}
    dbody = dict(body, stream=True, max_tokens=4)

    async def pairs(post_p, open_d) -> list[float]:
        times = []
        for i in range(n + 30):
            t = time.perf_counter()
            await asyncio.gather(post_p(), open_d())
            if i >= 30:  # warm-up
                times.append((time.perf_counter() - t) * 1000)
        return times

    async def with_httpx() -> list[float]:
        async with httpx.AsyncClient() as c:
            async def post_p():
                (await c.post(p_url + "/v1/completions", json=body)).json()

            async def open_d():
                r = await c.send(c.build_request("POST", d_url + "/v1/completions",
                                                 json=dbody), stream=True)
                async for chunk in r.aiter_bytes():
                    if chunk:
                        break
                await r.aclose()
            return await pairs(post_p, open_d)

    async def with_aiohttp(trust_env: bool = False) -> list[float]:
        async with aiohttp.ClientSession(trust_env=trust_env) as c:
            async def post_p():
                async with c.post(p_url + "/v1/completions", json=body) as r:
                    await r.json()

            async def open_d():
                async with c.post(d_url + "/v1/completions", json=dbody) as r:
                    async for chunk in r.content.iter_any():
                        if chunk:
                            break
            return await pairs(post_p, open_d)

    async def main() -> dict:
        out: dict = {"httpx": [], "aiohttp": [], "aiohttp_trust_env": []}
        for _ in range(2):  # alternating passes
            out["httpx"] += await with_httpx()
            out["aiohttp"] += await with_aiohttp()
            out["aiohttp_trust_env"] += await with_aiohttp(trust_env=True)
        return {k: _stats(v) for k, v in out.items()}

    os.sched_setaffinity(0, {0})
    try:
        return uvloop.run(main())
    finally:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "router_overhead.json"),
                    help="the JSON; the default overwrites the committed result")
    ap.add_argument("--gap-s", type=float, default=0.0,
                    help="pause after each request: idle processes between requests, as at "
                         "concurrency 1 with think time (0: back to back)")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="send a token-id list of this length (the benchmarks' prompts) instead "
                         "of a 300-word string")
    ap.add_argument("--baseline", default=None, metavar="CHECKOUT",
                    help="also run the router of this checkout (e.g. a git worktree of an "
                         "earlier commit), alternating with this one's on the same fakes")
    args = ap.parse_args()
    fakes = subprocess.Popen(["taskset", "-c", "1", sys.executable, __file__, "--fakes"],
                             stdout=subprocess.PIPE, text=True)
    try:
        p_url, d_url = fakes.stdout.readline().split()
        load0 = os.getloadavg()
        result = {"hop": hop(p_url, d_url, args.requests, args.gap_s, args.prompt_tokens,
                              args.baseline),
                  "clients": clients(p_url, d_url, args.requests)}
        load1 = os.getloadavg()
    finally:
        fakes.kill()
        fakes.wait()
    result["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "commit": source_commit(), "host": platform.node(), "cpus": os.cpu_count(),
                      "requests": args.requests, "gap_s": args.gap_s,
                      "prompt_tokens": args.prompt_tokens, "loadavg_before": load0,
                      "loadavg_after": load1}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    h, c = result["hop"], result["clients"]
    base = (f"; baseline router {h['baseline_router']['p50_ms']:.2f} ms, CPU "
            f"{h['baseline_router']['cpu_ms_per_request']:.3f} ms/request"
            if "baseline_router" in h else "")
    print(f"TTFT direct {h['direct']['p50_ms']:.2f} ms, through the router "
          f"{h['router']['p50_ms']:.2f} ms (added {h['added_p50_ms']:.2f} ms, p50; its CPU "
          f"{h['router']['cpu_ms_per_request']:.3f} ms/request){base}; leg pair: "
          f"httpx {c['httpx']['p50_ms']:.2f} ms, aiohttp {c['aiohttp']['p50_ms']:.2f} ms "
          f"(with trust_env {c['aiohttp_trust_env']['p50_ms']:.2f} ms); "
          f"wrote {out}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--fakes"]:
        asyncio.run(_fakes())
    else:
        main()
