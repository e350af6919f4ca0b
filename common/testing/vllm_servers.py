"""Start and stop real ``vllm serve`` processes (CPU build) and our router, for the end-to-end
tests (tests/test_e2e_vllm.py) and the serving benchmark (benchmarks/bench_serving.py).

Servers run with the Python of a given virtual environment (so one suite can test several vLLM
versions), each pinned to its own core, with the settings measured in shared/notes/vllm-on-cpu.md.
``build_tiny_model`` builds the tiny random model they serve (``tiny_model``).

Data type: on CPUs with AMX (Sapphire Rapids and later) vLLM's bf16 CPU attention picks its
``amx`` kernel, and a decode server's worker dies there with SIGILL on its first step for a
remotely prefilled request (shared/notes/vllm-on-cpu.md; vLLM's own ``NixlConnector`` too). So
every server gets ``--dtype float16`` on such CPUs (vLLM then picks its ``vec`` kernel) and keeps
the model's bf16 elsewhere: ``server_dtype`` decides, ``KV_PUSH_E2E_DTYPE`` overrides
(``auto``, the default; ``float16``, ``bfloat16``, or any other vLLM ``--dtype`` value).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from kv_push.common.testing.ports import free_port  # noqa: F401  (tests import it from here)

#: the environment variable that overrides the servers' ``--dtype`` (see the module docstring)
DTYPE_ENV = "KV_PUSH_E2E_DTYPE"


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The ``flags`` the CPU lists in ``cpuinfo``, or None where they cannot be read."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[-1].split())
    return None


def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises AMX tiles (the ``amx_tile`` flag, as vLLM's kernel choice
    via ``torch.cpu._is_amx_tile_supported()`` needs it)."""
    return "amx_tile" in (cpu_flags(cpuinfo) or ())


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU computes bf16 itself (``avx512_bf16`` or ``amx_bf16``), or where that
    cannot be read; without, vLLM's CPU build emulates it and rounds by the shape of each
    matmul (``e2e_exact_dtype``)."""
    flags = cpu_flags(cpuinfo)
    return flags is None or bool({"avx512_bf16", "amx_bf16"} & flags)


def e2e_exact_dtype(env: dict[str, str] | None = None, cpuinfo: str = "/proc/cpuinfo"
                    ) -> str | None:
    """The ``--dtype`` the end-to-end tests force (through ``DTYPE_ENV``) so that P/D's outputs
    can be compared with a single server's token for token, or None.

    On a CPU without native bf16 (an AVX2-only EPYC, 2026-12-06) the single server computes the
    first token's logits in its prefill (every prompt token in one forward) but D in a one-token
    recompute of the last prompt token over the KV P wrote, and emulated bf16 rounds the two
    apart (logprobs 1e-5 to 5e-5): the random tiny model's near-tied logits then pick another
    greedy token (measured: a streamed completion's first token). float32 is computed natively
    there. Not where ``DTYPE_ENV`` is set already."""
    env = os.environ if env is None else env
    if env.get(DTYPE_ENV, "auto").strip() not in ("", "auto"):
        return None
    return None if cpu_has_native_bf16(cpuinfo) else "float32"


def server_dtype(env: dict[str, str] | None = None, cpuinfo: str = "/proc/cpuinfo"
                 ) -> tuple[str | None, str]:
    """(the ``--dtype`` every CPU server gets, or None for the model's own; why)."""
    env = os.environ if env is None else env
    forced = env.get(DTYPE_ENV, "auto").strip() or "auto"
    if forced != "auto":
        return forced, f"{DTYPE_ENV}={forced}"
    if cpu_has_amx(cpuinfo):
        return "float16", ("this CPU has AMX: bf16 CPU attention (amx kernel) dies with SIGILL "
                           "in P/D, float16 selects the vec kernel")
    return None, "no AMX on this CPU: the model's bf16"


class Server:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, log_dir: Path):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        # PYTHONSAFEPATH: `python -m ...` must not put the working directory first on sys.path,
        # where a checkout's bare kv_push/ folder would hide the kv_push under test (kvtest's
        # shim on PYTHONPATH, or the installed one)
        # process_group=0: a process group of its own (stop() signals the whole server), in
        # the caller's session. Not a session of its own: with the kernel's autogroup
        # scheduling (sched_autogroup_enabled, on by default) each session is one scheduling
        # group, and on a box with fewer cores than busy processes (a vLLM worker busy-polls its
        # queue for 1 s after each step) a server's woken API process then waited 50-350 ms
        # for a CPU held by another server's group: TTFT outliers that were the box's, not ours
        # (docs/ttft-breakdown.md).
        group = ({"process_group": 0} if sys.version_info >= (3, 11)
                 else {"preexec_fn": os.setpgrp})
        # vLLM's processes talk over ZMQ ipc sockets in VLLM_RPC_BASE_PATH (/tmp by default);
        # a server killed, or one whose engine died, leaves them behind: a suite's worth of
        # servers left about a thousand in /tmp. Each server gets a folder of its own, removed
        # when it has stopped -- unless the caller or the environment names one. In /tmp, not
        # $TMPDIR: a socket's path (the folder, '/', a 36-character uuid) must fit in 107 bytes.
        self._rpc_dir = None
        if "VLLM_RPC_BASE_PATH" not in env and "VLLM_RPC_BASE_PATH" not in os.environ:
            self._rpc_dir = tempfile.mkdtemp(prefix="kvp-rpc-",
                                             dir="/tmp" if os.path.isdir("/tmp") else None)
            env = {**env, "VLLM_RPC_BASE_PATH": self._rpc_dir}
        try:
            self.proc = subprocess.Popen(argv, env={**os.environ, "PYTHONSAFEPATH": "1", **env},
                                         stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, **group)
        except BaseException:
            self._log.close()
            if self._rpc_dir is not None:
                shutil.rmtree(self._rpc_dir, ignore_errors=True)
            raise

    def wait_healthy(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._remove_rpc_dir()  # a failed start is not always stopped by its caller
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.failure_excerpt()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} not healthy after {timeout}s:\n{self.failure_excerpt()}")

    def failure_excerpt(self, first: int = 40, last: int = 30) -> str:
        """The log's first error (where vLLM's engine core says why it failed) and its end.

        A failed engine core is reported last by the API server, in a traceback of its own that
        fills a plain tail ("Engine core initialization failed. See root cause above"): the root
        cause is the first ``ERROR`` line or traceback, printed by the engine core earlier."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        start = next((i for i, line in enumerate(lines)
                      if " ERROR " in line or line.startswith("Traceback")), None)
        if start is None or start + first >= len(lines) - last:
            return "\n".join(lines[-(first + last):])
        return "\n".join([*lines[start:start + first], "[...]", *lines[-last:]])

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL after 30 s; also when the leader (the
        API server) is gone already but processes it started are not (an engine or worker left
        behind by a crash)."""
        if self.proc.poll() is None or self.pids():
            self._signal_group(signal.SIGTERM)
            if not self._wait_gone(30):
                self._signal_group(signal.SIGKILL)
                # a big process on a loaded box can take a while to go
                if not self._wait_gone(120):
                    print(f"{self.name} (pid {self.proc.pid}) still there after SIGKILL",
                          file=sys.stderr)
        self._log.close()
        self._remove_rpc_dir()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _wait_gone(self, timeout: float) -> bool:
        """Wait until the leader and every process of its group are gone."""
        deadline = time.monotonic() + timeout
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        while self.pids():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _remove_rpc_dir(self) -> None:
        """Remove this server's ipc folder once none of its processes is left to use it."""
        if self._rpc_dir is not None and self.proc.poll() is not None and not self.pids():
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None

    def _group_stats(self) -> list[tuple[int, list[str]]]:
        """(pid, ``/proc/<pid>/stat`` fields after the command name) of every live process of
        this server: the process group it leads (it and everything it spawned)."""
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == self.proc.pid and fields[0] != "Z":  # not zombies
                    out.append((int(stat.parent.name), fields))
            except (OSError, IndexError, ValueError):
                continue
        return out

    def pids(self) -> list[int]:
        """The live processes of this server."""
        return [pid for pid, _ in self._group_stats()]

    def rss_bytes(self) -> int:
        """Resident memory of every live process of this server."""
        return sum(int(f[21]) for _, f in self._group_stats()) * os.sysconf("SC_PAGE_SIZE")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the live processes of this server have used so far."""
        return sum(int(f[11]) + int(f[12]) for _, f in self._group_stats()) / os.sysconf(
            "SC_CLK_TCK")

    def kill9(self) -> None:
        self._signal_group(signal.SIGKILL)
        self._wait_gone(120)
        self._remove_rpc_dir()


def vllm_server(name: str, *, python: str, model: str, port: int, cpu: int | str, log_dir: Path,
                kv_role: str | None = None, kv_port: int | None = None, connector: str = "push",
                extra_config: dict | None = None, extra_env: dict | None = None,
                max_model_len: int = 1024, by_name: bool = False,
                engine_id: str | None = None, dtype: str | None = "default", tp: int = 1,
                block_size: int | None = None, kv_config: dict | None = None,
                whole_server_on_cpu: bool = False, vllm_args: Sequence[str] = ()) -> Server:
    """A ``vllm serve`` of ``model`` on ``port``, its OpenMP threads bound to core ``cpu``
    (``tp`` ranks: one per entry of ``cpu`` given as ``"0|1"``, or all on ``cpu``).

    ``whole_server_on_cpu``: its API server and engine core too (``taskset``), not only the
    worker: on a box with fewer cores than busy processes, each server then competes for its
    own core(s) only, as it would on a machine of its own (``bench_ttft_breakdown.py``).

    ``dtype``: ``"default"`` takes ``server_dtype()`` (float16 on AMX CPUs), None the model's.
    ``kv_config``: more top-level ``--kv-transfer-config`` keys (``kv_load_failure_policy``).
    ``vllm_args``: more ``vllm serve`` arguments (``--max-num-batched-tokens``).
    """
    if dtype == "default":
        dtype = server_dtype()[0]
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", "tiny", "--port", str(port), "--host", "127.0.0.1",
            "--enforce-eager", "--max-model-len", str(max_model_len), "--seed", "0"]
    if dtype:
        argv += ["--dtype", dtype]
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    if block_size is not None:
        argv += ["--block-size", str(block_size)]
    if isinstance(vllm_args, str):  # (a string would go in character by character)
        raise TypeError("vllm_args is a sequence of arguments, not one string")
    argv += list(vllm_args)  # more `vllm serve` arguments, as given
    bind = str(cpu)
    if tp > 1 and "|" not in bind:
        bind = "|".join([bind] * tp)
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": bind,
           "KV_PUSH_BACKEND": "host", "PYTHONUNBUFFERED": "1"}
    if kv_role is not None:
        if connector == "push":
            cfg = {"kv_connector": "KVPushConnector",
                   "kv_connector_module_path": "kv_push.common.connector",
                   "kv_role": kv_role, "kv_buffer_device": "cpu",
                   "kv_connector_extra_config": {"side_channel_port": kv_port,
                                                 **(extra_config or {})}}
            if by_name:  # found through our vllm.general_plugins entry point
                del cfg["kv_connector_module_path"]
        else:  # vLLM's own connectors: NixlConnector (pull) or NixlPushConnector
            cfg = {"kv_connector": connector, "kv_role": kv_role, "kv_buffer_device": "cpu",
                   "kv_connector_extra_config": extra_config or {}}
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(kv_port)
        if engine_id is not None:  # fixed, so a router can be told it up front
            cfg["engine_id"] = engine_id
        cfg.update(kv_config or {})
        argv += ["--kv-transfer-config", json.dumps(cfg)]
    env.update(extra_env or {})
    if whole_server_on_cpu:
        argv = ["taskset", "-c", bind.replace("|", ","), *argv]
    return Server(name, argv, env, port, log_dir)


def router(*, python: str, port: int, prefill: list[tuple], decode: list[str],
           log_dir: Path, mode: str = "push", name: str = "router",
           extra_env: dict | None = None, extra_args: list[str] | None = None,
           cpu: int | str | None = None) -> Server:
    """Our router (``cpu``: bound to those cores with ``taskset``; by default it floats)."""
    argv = [python, "-m", "kv_push.common.router", "--host", "127.0.0.1", "--port", str(port),
            "--mode", mode, *(extra_args or [])]
    for url, kv_port, *engine in prefill:  # (url, kv port[, engine id])
        spec = f"{url},kv=127.0.0.1:{kv_port}" + (f",engine_id={engine[0]}" if engine else "")
        argv += ["--prefill", spec]
    for url in decode:
        argv += ["--decode", url]
    if cpu is not None:
        argv = ["taskset", "-c", str(cpu), *argv]
    return Server(name, argv, {"PYTHONUNBUFFERED": "1", **(extra_env or {})}, port, log_dir)


def build_tiny_model(out: Path) -> Path:
    """The tiny model in ``out`` (built by ``tiny_model`` in a child Python unless already
    there)."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    # run from out's parent: a checkout's root would put its bare kv_push/ folder first on sys.path
    subprocess.run([sys.executable, "-m", "kv_push.common.testing.tiny_model", str(out)],
                   check=True, capture_output=True, cwd=out.parent)
    return out


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples matching ``labels`` (0 when absent)."""
    return metric_in(httpx.get(f"{url}/metrics", timeout=10).text, name, **labels)


def metric_in(text: str, name: str, **labels: str) -> float:
    """:func:`metric` over an exposition already read (several metrics from one read)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
