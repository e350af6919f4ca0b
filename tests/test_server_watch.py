"""A worker notices when the vLLM server it belongs to is gone (``common/server_watch.py``).

Real processes: an "API server" that starts an "engine" (vLLM's process title, set the way vLLM
sets it) and is then killed with SIGKILL, as an operator's ``kill -9`` of a vLLM server's API
process does; the engine is re-parented and goes on running, as vLLM's does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kv_push.common.server_watch import ServerWatch, parent_of, title_of

from kv_push.common.testing.vllm_servers import free_port

from conftest import bindable

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")

# the "API server": starts the engine (argv[1]: its code, argv[2:]: its arguments), says its
# pid, then waits to be killed
API = ("import subprocess, sys, time\n"
       "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], *sys.argv[2:]])\n"
       "print('engine', child.pid, flush=True)\n"
       "time.sleep(600)\n")
TITLE = "import setproctitle; setproctitle.setproctitle({!r})\n"
ENGINE = TITLE.format("VLLM::EngineCore") + (
    "import subprocess, sys, time\n"
    "if len(sys.argv) > 1:  # and a worker under it\n"
    "    w = subprocess.Popen([sys.executable, '-c', sys.argv[1]])\n"
    "    print('worker', w.pid, flush=True)\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n")
WORKER = TITLE.format("VLLM::Worker_TP0") + (
    "import time; print('worker-ready', flush=True); time.sleep(600)\n")
PRODUCER = TITLE.format("VLLM::EngineCore") + (
    "import logging, sys, time\n"
    "logging.basicConfig(level=logging.INFO)\n"
    "from kv_push.common.config import PushConfig\n"
    "from kv_push.common.testing.host_pool import HostPool\n"
    "from kv_push.common.worker import PushWorker\n"
    "pool = HostPool(placement='kv_split', num_layers=2, num_kv_heads=2, head_size=8,\n"
    "                dtype_bytes=2, block_size=16, num_blocks=8)\n"
    "PushWorker(geometry=pool.geometry, role='producer',\n"
    "           config=PushConfig(side_channel_port=int(sys.argv[1]))).start()\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n")


class Server:
    """The API process and what it started; its output (and its children's) collected."""

    def __init__(self, *args: str):
        self.api = subprocess.Popen([sys.executable, "-c", API, *args], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.pids: dict[str, int] = {}

    def _read(self) -> None:
        for line in self.api.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, pred, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if pred(line):
                        return line
                left = deadline - time.monotonic()
                assert left > 0, f"not seen within {timeout}s; output: {self.lines[-30:]}"
                self._cond.wait(left)

    def started(self, *names: str) -> "Server":
        for name in names:
            self.pids[name] = int(self.wait_for(lambda l, n=name: l.startswith(n + " ")).split()[1])
        self.wait_for(lambda l: l == "ready")
        return self

    def kill_api(self) -> None:
        self.api.send_signal(signal.SIGKILL)
        self.api.wait(30)

    def close(self) -> None:
        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.api.poll() is None:
            self.api.kill()
            self.api.wait(30)


@pytest.fixture
def servers():
    made: list[Server] = []
    yield lambda *args: made.append(Server(*args)) or made[-1]
    for s in made:
        s.close()


def _wait(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_an_engine_whose_api_server_was_killed_is_seen_gone(servers):
    s = servers(ENGINE).started("engine")
    engine = s.pids["engine"]
    assert "::EngineCore" in title_of(engine)
    watch = ServerWatch(engine)
    assert watch.watching and watch.engine == engine and watch.parent == s.api.pid
    assert watch.gone() is None
    s.kill_api()
    _wait(lambda: parent_of(engine) != s.api.pid)
    assert os.path.exists(f"/proc/{engine}")  # the engine goes on running, orphaned
    why = watch.gone()
    assert why is not None and f"process {s.api.pid}, which started its engine process " \
        f"{engine}, is gone" in why


def test_a_worker_watches_its_engines_parent(servers):
    s = servers(ENGINE, WORKER).started("engine", "worker")
    s.wait_for(lambda l: l == "worker-ready")  # its title is set
    watch = ServerWatch(s.pids["worker"])
    assert watch.engine == s.pids["engine"] and watch.parent == s.api.pid
    os.kill(s.pids["engine"], signal.SIGKILL)  # the engine itself dies
    _wait(lambda: watch.gone() is not None)


def test_a_process_without_vllms_titles_is_not_watched():
    assert not ServerWatch(os.getpid()).watching  # pytest: no title, pid given


def test_a_producer_whose_server_is_gone_closes_and_frees_its_side_channel_port(servers):
    # the walkthrough's case: P's API server killed alone; a P started in its place could not
    # listen on the side-channel port the orphaned engine's worker still held
    port = free_port()
    s = servers(PRODUCER, str(port)).started("engine")
    assert not bindable(port)  # the worker listens for handshakes
    s.kill_api()
    _wait(lambda: bindable(port), timeout=30)
    line = s.wait_for(lambda l: "the vLLM server of this engine is gone" in l)
    assert f"process {s.api.pid}, which started its engine process {s.pids['engine']}" in line
    assert os.path.exists(f"/proc/{s.pids['engine']}")  # vLLM's engine itself is left alone


def _watch_in_child(q) -> None:
    from kv_push.common.server_watch import ServerWatch as Watch

    w = Watch()
    q.put((w.watching, w.engine, w.parent, os.getpid(), os.getppid()))


def test_a_process_started_by_multiprocessing_without_titles_watches_its_parent():
    # the fallback where vLLM's titles are missing (no setproctitle): a multiprocessing
    # child watches the process that started it
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_watch_in_child, args=(q,))
    child.start()
    watching, engine, parent, pid, ppid = q.get(timeout=60)
    child.join(60)
    assert watching and engine == pid and parent == ppid == os.getpid()


def test_the_watch_can_be_turned_off(servers):
    port = free_port()
    os.environ["KV_PUSH_SERVER_WATCH"] = "0"  # the children inherit it
    try:
        s = servers(PRODUCER, str(port)).started("engine")
    finally:
        del os.environ["KV_PUSH_SERVER_WATCH"]
    s.kill_api()
    time.sleep(3)  # three looks' time: nothing closes
    assert not bindable(port)
    assert not any("the vLLM server of this engine is gone" in l for l in s.lines)
