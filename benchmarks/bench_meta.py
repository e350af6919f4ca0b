"""What the benchmarks record about the code they measured."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def source_commit() -> str:
    """The checkout's short HEAD, with ``+uncommitted changes`` when tracked files other than
    ``benchmarks/results`` differ from it (a run of code no commit holds); ``BENCH_COMMIT``
    from the environment outside a git checkout (a copy on a device machine)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True,
                              text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return os.environ.get("BENCH_COMMIT", "")
    # result files written by an earlier run of the same session are not code
    if git("status", "--porcelain", "--untracked-files=no", "--", ".",
           ":(exclude)benchmarks/results"):
        commit += "+uncommitted changes"
    return commit


#: the CPU's vector extensions that decide how fast vLLM's CPU build runs a model (bf16 without
#: AVX-512 BF16 or AMX is emulated: a prefill several times slower, so the same fixed P/D
#: overhead is a much smaller ratio)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_isa(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """Which of :data:`ISA_FLAGS` the CPU lists (empty where it cannot be read)."""
    from kv_push.common.testing.vllm_servers import cpu_flags

    flags = cpu_flags(cpuinfo) or set()
    return [f for f in ISA_FLAGS if f in flags]


def server_dtype() -> dict[str, str]:
    """The ``--dtype`` the launcher gives every server on this machine and why (the model's bf16
    unless ``KV_PUSH_E2E_DTYPE`` says otherwise or the CPU has AMX): a float32 server on a CPU
    that emulates bf16 prefills several times faster, which moves every TTFT ratio."""
    from kv_push.common.testing.vllm_servers import server_dtype as chosen

    dtype, why = chosen()
    return {"server_dtype": dtype or "model's own", "server_dtype_why": why}


def checkout_env(source: str | None, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment in which ``python -m kv_push...`` (run from a cwd that is no checkout)
    imports the ``kv_push`` of checkout ``source`` (None: the installed one), to run an earlier
    commit's code beside this one's (``--baseline`` of the benchmarks): a folder holding only
    ``kv_push`` -> that checkout, first on ``PYTHONPATH``."""
    env = {**(os.environ if env is None else env), "PYTHONSAFEPATH": "1"}
    if source:
        shim = Path(f"/tmp/kv_push_checkout_{os.getpid()}_{abs(hash(source))}")
        shim.mkdir(exist_ok=True)
        link = shim / "kv_push"
        if not link.is_symlink():
            link.symlink_to(Path(source).resolve())
        env["PYTHONPATH"] = f"{shim}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def add_python_arg(ap: argparse.ArgumentParser) -> None:
    """``--python``: the interpreter a benchmark starts its servers with; by default the
    checkout's ``.venv`` where it has one (``make`` builds it), else the interpreter running the
    benchmark (a fresh clone run with another checkout's venv)."""
    venv = REPO / ".venv" / "bin" / "python"
    ap.add_argument("--python", default=str(venv) if venv.exists() else sys.executable,
                    help="the servers' interpreter (default: this checkout's .venv if it has "
                         "one, else the one running this script)")
