"""The TTFT breakdown benchmark's client and report without servers: what one streamed request
records (TTFT, first gap, mean gap) and the "After the first token" table of ``--report``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_ttft_breakdown as tb  # noqa: E402


class SlowStream(httpx.SyncByteStream):
    """A completion stream whose token events come ``gaps`` seconds apart."""

    def __init__(self, gaps):
        self.gaps = gaps

    def __iter__(self):
        for i, gap in enumerate(self.gaps):
            time.sleep(gap)
            yield f'data: {{"choices": [{{"index": 0, "text": "t{i}"}}]}}\n\n'.encode()
        yield b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\ndata: [DONE]\n\n'


def test_one_request_records_the_first_gap_apart_from_the_mean_gap():
    gaps = [0.0, 0.25, 0.05, 0.05]  # a long first gap, then short ones
    client = httpx.Client(transport=httpx.MockTransport(
        lambda request: httpx.Response(200, stream=SlowStream(gaps))))
    rec = tb.one_request(client, "http://p", [11, 12, 13], max_tokens=4)
    assert "error" not in rec
    assert 0.24 <= rec["gap1"] < 0.35
    assert 0.11 <= rec["itl"] < 0.2  # (0.25 + 0.05 + 0.05) / 3
    assert rec["e2e"] >= rec["ttft"] + 0.34


def test_report_writes_the_after_the_first_token_table_from_the_json(tmp_path):
    src = REPO / "benchmarks" / "results" / "ttft_breakdown.experiment_after_output.run1.json"
    result = json.loads(src.read_text())
    reqs = result["groups"][0]["systems"][0]["requests"]
    for r, gap in zip(reqs, [0.004, 0.005, 0.006] * len(reqs)):
        if "ttft" in r:
            r["gap1"] = gap
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_ttft_breakdown.py"),
                    "--report", str(path)], check=True, cwd=tmp_path)
    md = (tmp_path / "r.md").read_text()
    table = md.split("## After the first token")[1].split("\n## ")[0]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
             if line.startswith("| first |")]
    rows = {c[1]: c[2:] for c in cells}
    # single first gap, push first gap, single mean gap, push mean gap, single / push response
    assert rows["push first-token=prefill"] == ["-", "5.0 ms", "2.8 ms", "6.0 ms", "23.2 ms",
                                                "36.0 ms"]
    assert rows["push first-token=decode"][:2] == ["-", "-"]  # not recorded in that run
