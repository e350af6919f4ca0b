"""The real-vLLM server launcher's choices (no vLLM started): the data type on AMX CPUs, and the
command line it builds."""

from __future__ import annotations

import json

from kv_push.common.testing.vllm_servers import (DTYPE_ENV, cpu_has_amx, e2e_exact_dtype,
                                                 server_dtype, vllm_server)

SPR = "flags\t\t: fpu vme sse sse2 avx512f avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8\n"
ICELAKE = "flags\t\t: fpu vme sse sse2 avx512f avx512_vnni\n"


def _cpuinfo(tmp_path, flags: str) -> str:
    path = tmp_path / f"cpuinfo-{len(flags)}"
    path.write_text("processor\t: 0\nmodel name\t: x\n" + flags + "\nprocessor\t: 1\n" + flags)
    return str(path)


def test_amx_cpus_get_float16_others_keep_the_models_dtype(tmp_path):
    spr, icx = _cpuinfo(tmp_path, SPR), _cpuinfo(tmp_path, ICELAKE)
    assert cpu_has_amx(spr) and not cpu_has_amx(icx)
    assert not cpu_has_amx(str(tmp_path / "missing"))
    dtype, why = server_dtype(env={}, cpuinfo=spr)
    assert dtype == "float16" and "AMX" in why
    dtype, why = server_dtype(env={}, cpuinfo=icx)
    assert dtype is None and "no AMX" in why


def test_the_e2e_tests_force_float32_where_bf16_is_emulated(tmp_path):
    """An AVX2-only CPU (no avx512_bf16, no amx_bf16) rounds emulated bf16 by matmul shape: the
    e2e servers get float32 there (conftest sets DTYPE_ENV), and nothing where bf16 is native,
    or where DTYPE_ENV already names a dtype."""
    avx2 = _cpuinfo(tmp_path, "flags\t\t: fpu sse sse2 avx avx2 fma\n")
    zen4 = _cpuinfo(tmp_path, "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n")
    assert e2e_exact_dtype(env={}, cpuinfo=avx2) == "float32"
    assert e2e_exact_dtype(env={}, cpuinfo=_cpuinfo(tmp_path, ICELAKE)) == "float32"
    assert e2e_exact_dtype(env={}, cpuinfo=zen4) is None
    assert e2e_exact_dtype(env={}, cpuinfo=_cpuinfo(tmp_path, SPR)) is None
    assert e2e_exact_dtype(env={DTYPE_ENV: "bfloat16"}, cpuinfo=avx2) is None
    assert e2e_exact_dtype(env={DTYPE_ENV: "auto"}, cpuinfo=avx2) == "float32"
    assert e2e_exact_dtype(env={}, cpuinfo=str(tmp_path / "missing")) is None


def test_the_environment_forces_a_dtype(tmp_path):
    spr = _cpuinfo(tmp_path, SPR)
    assert server_dtype(env={DTYPE_ENV: "bfloat16"}, cpuinfo=spr) == (
        "bfloat16", f"{DTYPE_ENV}=bfloat16")
    assert server_dtype(env={DTYPE_ENV: "float16"}, cpuinfo=_cpuinfo(tmp_path, ICELAKE))[0] \
        == "float16"
    assert server_dtype(env={DTYPE_ENV: "auto"}, cpuinfo=spr)[0] == "float16"


def test_command_line(tmp_path, monkeypatch):
    """``/bin/true`` stands in for Python: the argv and environment are what would run."""
    monkeypatch.setenv(DTYPE_ENV, "float16")
    s = vllm_server("p", python="/bin/true", model="m", port=1234, cpu="0|1", log_dir=tmp_path,
                    kv_role="kv_producer", kv_port=5600, tp=2, block_size=64,
                    kv_config={"kv_load_failure_policy": "recompute"})
    s.proc.wait(10)
    s.stop()
    argv = s.proc.args
    assert argv[argv.index("--dtype") + 1] == "float16"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--block-size") + 1] == "64"
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert cfg["kv_load_failure_policy"] == "recompute" and cfg["kv_role"] == "kv_producer"
    monkeypatch.setenv(DTYPE_ENV, "auto")
    s = vllm_server("q", python="/bin/true", model="m", port=1235, cpu=1, log_dir=tmp_path,
                    dtype=None)
    s.proc.wait(10)
    s.stop()
    assert "--dtype" not in s.proc.args and "--tensor-parallel-size" not in s.proc.args


def test_a_server_accounts_for_its_whole_process_group(tmp_path):
    """``pids``, ``cpu_seconds`` and ``rss_bytes`` (the benchmarks' readings) cover the server's
    children too, and nothing outside its group; a stopped server has no processes left."""
    import os
    import sys
    import time

    from kv_push.common.testing.vllm_servers import Server

    child = ("import subprocess, sys, time; "
             "c = subprocess.Popen([sys.executable, '-c', "
             "'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass"
             "\\nprint(\"spun\", flush=True)\\ntime.sleep(60)']); time.sleep(60)")
    server = Server("group", [sys.executable, "-c", child], {}, 0, tmp_path)
    try:
        deadline = time.monotonic() + 30
        while "spun" not in server.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = server.pids()
        assert server.proc.pid in pids and len(pids) == 2 and os.getpid() not in pids
        assert server.cpu_seconds() >= 0.3  # the grandchild's spin counts
        assert server.rss_bytes() > 1 << 20
    finally:
        server.stop()
    deadline = time.monotonic() + 10  # the grandchild got SIGTERM with the group: it goes soon
    while server.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.pids() == [] and server.cpu_seconds() == 0


def test_a_server_s_ipc_sockets_go_with_it(tmp_path):
    """vLLM puts its processes' ZMQ ipc sockets in ``VLLM_RPC_BASE_PATH``: each server gets a
    folder of its own, removed with whatever a killed server left in it, whether it was
    stopped or killed, and also when the leader had exited and left a child behind (stopped
    with it); a folder the caller chose is left alone."""
    import os
    import sys
    import time

    from kv_push.common.testing.vllm_servers import Server

    bind = ("import os, socket, time; s = socket.socket(socket.AF_UNIX); "
            "s.bind(os.path.join(os.environ['VLLM_RPC_BASE_PATH'], 'engine')); "
            "print('bound', os.environ['VLLM_RPC_BASE_PATH'], flush=True); time.sleep(60)")
    # the leader starts the binding child and exits at once: the child outlives it
    orphan = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {bind!r}])"

    def bound(server: Server) -> str:
        deadline = time.monotonic() + 30
        while "bound" not in server.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "bound" in server.log_text(), server.log_text()
        return server.log_text().split()[-1]

    for end, script in (("stop", bind), ("kill9", bind), ("stop", orphan)):
        server = Server(end, [sys.executable, "-c", script], {}, 0, tmp_path)
        try:
            folder = bound(server)
            assert os.path.exists(os.path.join(folder, "engine"))  # the socket file is there
            assert len(os.path.join(folder, "0" * 36)) < 100        # room for vLLM's uuid names
            if script is orphan:
                server.proc.wait(30)
                assert server.pids(), "the child should outlive the leader"
        finally:
            getattr(server, end)()
        assert not os.path.exists(folder), (end, script is orphan)
        assert server.pids() == []

    mine = tmp_path / "rpc"
    mine.mkdir()
    server = Server("chosen", [sys.executable, "-c", bind],
                    {"VLLM_RPC_BASE_PATH": str(mine)}, 0, tmp_path)
    try:
        assert bound(server) == str(mine)
    finally:
        server.stop()
    assert mine.is_dir() and os.path.exists(mine / "engine")


def test_a_failed_start_reports_the_engines_root_cause(tmp_path):
    """vLLM's API server reports a failed engine core last, in a traceback longer than a plain
    tail ("See root cause above"): ``wait_healthy`` quotes the first error, and the end too."""
    import sys

    import pytest

    from kv_push.common.testing.vllm_servers import Server

    script = ("print('INFO starting'); "
              "print('(EngineCore pid=1) ERROR 12-04 EngineCore failed to start.'); "
              "print('HandshakeError: cannot listen on 0.0.0.0:20001 for KV handshakes'); "
              "[print(f'  File \"api.py\", line {i}, in run') for i in range(200)]; "
              "print('RuntimeError: Engine core initialization failed. See root cause above.'); "
              "raise SystemExit(1)")
    server = Server("prefill", [sys.executable, "-c", script], {}, 1, tmp_path)
    with pytest.raises(RuntimeError) as failed:
        server.wait_healthy(timeout=60)
    message = str(failed.value)
    assert "prefill exited with 1" in message
    assert "cannot listen on 0.0.0.0:20001" in message  # the root cause, 200 lines up
    assert "See root cause above" in message            # and the end
    assert "line 100," not in message                   # not the whole log
    assert server._rpc_dir is None                      # its ipc folder went with it


def test_ports_come_from_outside_the_ephemeral_range():
    """Ports the kernel hands to outgoing connections on its own (the ephemeral range) can be
    taken between the pick and a server's bind: the picks stay out of that range, are bindable
    and are never handed out twice."""
    import socket

    from kv_push.common.testing.ports import ephemeral_range, free_port, free_ports

    first, last = ephemeral_range()
    picked = [free_port() for _ in range(50)] + [free_ports(4) + i for _ in range(10)
                                                  for i in range(4)]
    assert len(set(picked)) == len(picked)
    assert not any(first <= p <= last for p in picked)
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked[-1]))


def test_ephemeral_range_is_read_from_the_kernel(tmp_path):
    from kv_push.common.testing.ports import ephemeral_range

    conf = tmp_path / "range"
    conf.write_text("10000\t20000\n")
    assert ephemeral_range(str(conf)) == (10000, 20000)
    assert ephemeral_range(str(tmp_path / "absent")) == (32768, 60999)


def test_e2e_signatures_tolerate_rounding_not_other_tokens_or_text():
    """``e2e_support.Signature``: P/D's choice equals the single server's when its token ids and
    text are the same and every logprob is within the tolerance; a different token, text, a
    logprob off by more, or one logprob more or fewer is a mismatch (also inside a tuple of
    choices, as ``signatures`` compares a prompt list)."""
    from e2e_support import LOGPROB_TOLERANCE, Signature

    ref = Signature(((5, 7), (-5.3968896, None), "ab"))
    near = Signature(((5, 7), (-5.3968896 + LOGPROB_TOLERANCE / 10, None), "ab"))
    assert ref == near and not ref != near and (ref, ref) == (near, near)
    assert hash(ref) == hash(near) and near in {ref}  # equal ones hash alike
    for other in (((5, 8), (-5.3968896, None), "ab"), ((5, 7), (-5.3968896, None), "aB"),
                  ((5, 7), (-5.3968896 + 2 * LOGPROB_TOLERANCE, None), "ab"),
                  ((5, 7), (-5.3968896, -1.0), "ab"), ((5, 7), (-5.3968896,), "ab")):
        assert ref != Signature(other) and not ref == Signature(other), other
        assert (ref,) != (Signature(other),)
