#!/usr/bin/env python3
"""Memory soak of a real vLLM P/D stack: push (ours) vs NixlConnector (vLLM pull).

usage: soak.py SYSTEM DURATION_S PORT_BASE    (SYSTEM: push | pull)
Writes /tmp/soakD/samples_<system>.jsonl (one line per 30 s sample) and
/tmp/soakD/summary_<system>.json; logs in /tmp/soakD/logs_<system>/.
"""
import asyncio
import json
import os
import random
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, "/work/main")
from common.testing.vllm_servers import router, vllm_server  # noqa: E402

os.environ["KV_PUSH_E2E_DTYPE"] = "float32"
OUT = Path("/tmp/soakD")
PY = "/work/main/.venv/bin/python"
MODEL = "/work/main/.work/tiny-model"
VOCAB = 462
SEED = 12345
SAMPLE_S = 30.0
CONC = 2

SYSTEMS = {"push": ("push", "push"), "pull": ("NixlConnector", "pull")}


class Ports:
    def __init__(self, base):
        self.next = base

    def __call__(self):
        while self.next < 32000:
            port, self.next = self.next, self.next + 1
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
        raise RuntimeError("no port")


def proc_info(pid):
    d = {"pid": pid}
    try:
        d["comm"] = Path(f"/proc/{pid}/comm").read_text().strip()
        d["cmd"] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")[:80]
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:", "VmSize:")):
                k, v = line.split(":")
                d[k] = int(v.split()[0])
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            k, v = line.split(":", 1)
            if k in ("Rss", "Private_Dirty", "Anonymous", "Pss"):
                d["sr_" + k] = int(v.split()[0])
    except (OSError, ValueError):
        pass
    return d


def snapshot(servers):
    return {s.name: [proc_info(pid) for pid in sorted(s.pids())] for s in servers}


class Load:
    def __init__(self, url):
        self.url = url
        self.done = self.errors = self.hangups = self.streams = self.nonstream = 0
        self.next_i = 0
        self.err_samples = []

    def spec(self, i):
        rng = random.Random(SEED * 1_000_003 + i)
        n = rng.randint(200, 500)
        prompt = [rng.randrange(3, VOCAB) for _ in range(n)]
        hang = (i % 10 == 9)
        stream = hang or rng.random() < 0.3
        return prompt, stream, hang

    async def one(self, client, i):
        prompt, stream, hang = self.spec(i)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "stream": stream}
        try:
            if not stream:
                r = await client.post(f"{self.url}/v1/completions", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                r.json()["choices"][0]["text"]
                self.nonstream += 1
            else:
                async with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}")
                    got = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            got += 1
                            if hang:
                                break  # closing the stream = hang-up
                    if got == 0:
                        raise RuntimeError("empty stream")
                if hang:
                    self.hangups += 1
                else:
                    self.streams += 1
            self.done += 1
        except Exception as e:  # noqa: BLE001
            self.errors += 1
            if len(self.err_samples) < 20:
                self.err_samples.append(f"req {i}: {type(e).__name__}: {e}"[:300])

    async def worker(self, stop_at):
        async with httpx.AsyncClient(timeout=60) as client:
            while time.monotonic() < stop_at:
                i, self.next_i = self.next_i, self.next_i + 1
                await self.one(client, i)

    async def run(self, duration):
        stop_at = time.monotonic() + duration
        await asyncio.gather(*(self.worker(stop_at) for _ in range(CONC)))


def main():
    system, duration, base = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    connector, mode = SYSTEMS[system]
    log_dir = OUT / f"logs_{system}"
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = Ports(base)
    servers = []
    samples_path = OUT / f"samples_{system}.jsonl"
    samples_path.write_text("")
    try:
        kv_port = ports()
        extra = None if connector == "push" else {"kv_lease_duration": 120}
        p = vllm_server("prefill", python=PY, model=MODEL, port=ports(), cpu=0, log_dir=log_dir,
                        kv_role="kv_producer", kv_port=kv_port, connector=connector,
                        extra_config=extra, whole_server_on_cpu=True)
        servers.append(p)
        d = vllm_server("decode", python=PY, model=MODEL, port=ports(), cpu=1, log_dir=log_dir,
                        kv_role="kv_consumer", kv_port=ports(), connector=connector,
                        extra_config=extra, whole_server_on_cpu=True)
        servers.append(d)
        p.wait_healthy(300)
        d.wait_healthy(300)
        r = router(python=PY, port=ports(), prefill=[(p.url, kv_port)], decode=[d.url],
                   log_dir=log_dir, mode=mode)
        servers.append(r)
        r.wait_healthy(60)
        print(f"[{time.strftime('%H:%M:%S')}] {system} up; P {p.url} D {d.url} R {r.url}",
              flush=True)
        load = Load(r.url)
        t0 = time.monotonic()
        stop = threading.Event()

        def sampler():
            with open(samples_path, "a") as f:
                while True:
                    t = time.monotonic() - t0
                    rec = {"t": round(t, 1), "done": load.done, "errors": load.errors,
                           "hangups": load.hangups, "issued": load.next_i,
                           "procs": snapshot(servers)}
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    print(f"[{time.strftime('%H:%M:%S')}] t={t:.0f} done={load.done} "
                          f"err={load.errors} hang={load.hangups} " + " ".join(
                              f"{n}:" + "/".join(str(x.get('VmRSS', 0) // 1024)
                                                 for x in ps)
                              for n, ps in rec["procs"].items()), flush=True)
                    if stop.wait(SAMPLE_S):
                        return

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        asyncio.run(load.run(duration))
        stop.set()
        th.join()
        with open(samples_path, "a") as f:  # final sample after the load stopped
            f.write(json.dumps({"t": round(time.monotonic() - t0, 1), "done": load.done,
                                "errors": load.errors, "hangups": load.hangups,
                                "issued": load.next_i, "final": True,
                                "procs": snapshot(servers)}) + "\n")
        counters = {}
        try:
            txt = httpx.get(f"{d.url}/metrics", timeout=10).text
            counters["d_metrics"] = [l for l in txt.splitlines()
                                     if l.startswith(("vllm:prompt_tokens_by_source_total",
                                                      "vllm:request_success_total"))]
            txt = httpx.get(f"{p.url}/metrics", timeout=10).text
            counters["p_metrics"] = [l for l in txt.splitlines()
                                     if l.startswith("vllm:request_success_total")]
        except httpx.HTTPError as e:
            counters["metrics_error"] = str(e)
        (OUT / f"summary_{system}.json").write_text(json.dumps(
            {"system": system, "duration": duration, "done": load.done, "errors": load.errors,
             "hangups": load.hangups, "streams": load.streams, "nonstream": load.nonstream,
             "issued": load.next_i, "err_samples": load.err_samples, **counters}, indent=1))
        print(f"[{time.strftime('%H:%M:%S')}] {system} done: {load.done} ok, {load.errors} err,"
              f" {load.hangups} hangups; errs {load.err_samples[:3]}", flush=True)
    finally:
        for s in reversed(servers):
            s.stop()
        print(f"[{time.strftime('%H:%M:%S')}] {system} stopped", flush=True)


if __name__ == "__main__":
    main()
