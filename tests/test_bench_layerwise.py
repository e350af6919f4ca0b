"""The layer-wise benchmark's bookkeeping (benchmarks/bench_layerwise_gpu.py): what one layer
group is, and how the tail is split from the peers' stamps. No timing is asserted."""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_layerwise_gpu as bl  # noqa: E402

QWEN = SimpleNamespace(layers=64, kv_heads=8, head_size=128, chunk_mib=512)


def test_one_group_is_one_chunk_of_the_request():
    # 16k tokens: 64 MiB a layer, 8 layers a chunk -> a 2,048-token request is one chunk
    assert bl.group_alone_tokens(16384, QWEN) == 2048
    assert bl.group_alone_tokens(4096, QWEN) == 2048  # 32 layers a chunk
    assert bl.group_alone_tokens(2048, QWEN) == 2048  # fits in one chunk: itself
    assert bl.group_alone_tokens(16384, SimpleNamespace(**{**vars(QWEN), "chunk_mib": 128})) == 512


def test_tail_steps_take_the_last_chunk():
    t0 = 100.0
    ev = [("p_post", 99.0, 0, 2), ("d_notice", 99.5, 0, 2), ("p_post", 100.001, 1, 2),
          ("d_notice", 100.002, 1, 2), ("d_unpacked", 100.0025, -1, -1)]
    st = bl.tail_steps(ev, t0, 100.003)
    assert round(st["first_post"]) == -1000
    assert round(st["last_post"], 3) == 1.0 and round(st["last_notice"], 3) == 2.0
    assert round(st["last_group_ms"], 3) == 2.0
    assert bl.tail_steps([("p_post", 1.0, 0, 1)], t0, 2.0) == {}


def test_ratio_and_group_alone_rows():
    assert bl.ratio(3.0, 2.0) == 1.5 and bl.ratio(-1.0, 2.0) is None
    rows = [{"tokens": 16384, "mode": "layerwise", "tail_ms_median": 1.5, "chunks": 8},
            {"tokens": 16384, "mode": "staged", "tail_ms_median": 8.0, "chunks": 8},
            {"tokens": 2048, "mode": "staged", "tail_ms_median": 3.0, "chunks": 1,
             "group_case": True}]
    bl.add_group_alone(rows, QWEN)
    assert rows[0]["group_alone_ms"] == 3.0 and rows[0]["tail_over_group_alone"] == 0.5
    assert rows[1]["tail_over_group_alone"] == 2.67
    assert "group_alone_ms" not in rows[2]
