"""Staged push VRAM -> VRAM between two processes on one CUDA GPU, bytes verified on the GPU.

``test_gpu_push.py``'s setup (P kv_split NHD block 16; decoders blocks_first block 32, NHD and
head-major HND; per-layer allocations as vLLM makes them; pattern fill on P, canary fill of D's
whole pool, on-GPU verification and a negative control), with staging pools on every worker
(``CudaBackend.alloc_staging``, registered with NIXL): P packs on a side stream after the event
``prefill_done`` recorded, WRITEs chunks of ``CHUNK`` bytes into D's slot, D unpacks each on a side
stream. D's counters must show the staged path (one staged transfer, several chunks, no fallback)
and every element of D's pool outside the target tokens must keep its canary -- an unpack that
wrote past its rows would show there.

Needs a CUDA GPU and the nixl package; ``KV_PUSH_TEST_DEVICE=cpu`` runs it on host tensors.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kv_push.common.staging import slot_layout
from kv_push.common.testing.block_ids import fragmented_blocks
from kv_push.common.testing.peer_process import LocalPeer

from test_gpu_push import D_BLOCKS, HEAD_SIZE, HEADS, LAYERS, P_BLOCKS, _spec, pytestmark  # noqa: F401

CHUNK = 1 << 20  # a layer of 1,000 tokens x 8 heads x 128 x bf16, K and V, is 3.9 MiB: 1 per chunk
STAGING = {"producer_staging_bytes": 64 << 20, "decoder_staging_bytes": 64 << 20,
           "staging_chunk_bytes": CHUNK}


@pytest.fixture(scope="module")
def peers():
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    specs = {
        "P": _spec("producer", "kv_split", "NHD", 16, P_BLOCKS, "per_layer",
                   engine_id="prefill-staged-gpu", config={"side_channel_port": 0, **STAGING}),
        "D_nhd": _spec("decoder", "blocks_first", "NHD", 32, D_BLOCKS, "per_layer",
                       engine_id="nhd-staged-gpu", config=STAGING),
        "D_hnd": _spec("decoder", "blocks_first", "HND", 32, D_BLOCKS, "per_layer",
                       engine_id="hnd-staged-gpu", config=STAGING),
    }
    with ThreadPoolExecutor(len(specs)) as ex:
        futures = {k: ex.submit(LocalPeer, s, 240.0) for k, s in specs.items()}
    started, errors = {}, []
    for k, f in futures.items():
        try:
            started[k] = f.result()
        except Exception as e:  # noqa: BLE001 - re-raised after cleaning up
            errors.append(e)
    if errors:
        for p in started.values():
            p.close()
        raise errors[0]
    try:
        yield started
    finally:
        for p in started.values():
            p.close()


_seq = iter(range(10_000))


@pytest.mark.parametrize("decoder,num_tokens,first_token", [
    ("D_nhd", 1000, 0),
    ("D_hnd", 1000, 0),   # head-major: every (token, head) vector is its own row in the unpack
    ("D_nhd", 2049, 64),  # prefix hit
])
def test_staged_vram_push_bytes_verified(peers, figures, decoder, num_tokens, first_token):
    P, D = peers["P"], peers[decoder]
    dgeo = D.call("geometry")
    i = next(_seq)
    rng = np.random.default_rng(700 + i)
    pblocks = fragmented_blocks(rng, P_BLOCKS, -(-num_tokens // 16))
    dblocks = fragmented_blocks(rng, D_BLOCKS, -(-(num_tokens - first_token) // 32))
    seed = 9000 + i
    P.call("fill", seed, num_tokens, pblocks, timeout=120)
    D.call("canary", timeout=120)
    before = D.call("counters")
    key, tid = f"staged-gpu-{i}", f"staged-gpu-xfer-{i}-{decoder}"
    D.call("expect_at", key, tid, 0, P.call("address"), dblocks, first_token, num_tokens)
    t0 = P.call("prefill_done_at", key, tid, pblocks, num_tokens)
    got = D.call("outcome_at", key, 60.0, timeout=90)
    assert got is not None and got[0] == "received", got
    assert P.call("wait_released", [key], 30.0) == [key]
    v = D.call("verify", seed, num_tokens, dblocks, first_token, timeout=120)
    assert v["mismatch"] == 0, f"{v['mismatch']} received elements differ from the pattern"
    assert v["canary"] == 0, f"{v['canary']} elements outside the target were overwritten"
    assert D.call("verify", seed + 1, num_tokens, dblocks, first_token, timeout=120)["mismatch"] > 0
    after = D.call("counters")
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    layout = slot_layout(dgeo, 1, first_token=first_token, num_tokens=num_tokens)
    assert d.get("staged_transfers") == 1 and d.get("staged_bytes") == layout.total_bytes, d
    assert d.get("staged_chunks") == LAYERS  # one layer per chunk at this size
    assert not any(k.startswith("staged_fallback") and n for k, n in d.items()), d
    # the kernels select_kernels picked (auto: fused Triton on CUDA, torch on host tensors) ran
    # the unpack: one launch per chunk for triton, more for the torch ops
    from kv_push.common.staging_triton import select_kernels

    kernel = select_kernels("cpu" if os.environ.get("KV_PUSH_TEST_DEVICE") == "cpu" else "cuda")
    launches = d.get(f"staging_launches{{{kernel}}}", 0)
    assert launches == LAYERS if kernel == "triton" else launches >= LAYERS * 2, d
    assert D.call("live")["staging_slots"] == 0 and P.call("live")["staging_rooms"] == 0
    figures("gpu staged push (VRAM->VRAM)", f"{decoder} {num_tokens - first_token} tok, "
            f"{LAYERS} chunks", got[2] - t0, f"{layout.total_bytes / 2**20:.1f} MiB verified")


@pytest.mark.parametrize("decoder,order", [("D_nhd", "reg_first"), ("D_hnd", "reg_first"),
                                           ("D_nhd", "prefill_first")])
def test_layerwise_stream_vram_bytes_verified(peers, figures, decoder, order):
    """Layer-wise streaming on the GPU: P's blocks of each layer are zero until the "forward"
    writes them back on the engine's stream after a device spin, right before ``layer_saved``;
    the packs wait for each layer's event, so D's bytes equal the pattern only when every pack
    ran after its layer's writes. Written from the stream: no pack after the prefill."""
    P, D = peers["P"], peers[decoder]
    num_tokens = 1000
    i = next(_seq)
    rng = np.random.default_rng(800 + i)
    pblocks = fragmented_blocks(rng, P_BLOCKS, -(-num_tokens // 16))
    dblocks = fragmented_blocks(rng, D_BLOCKS, -(-num_tokens // 32))
    seed = 9500 + i
    P.call("fill", seed, num_tokens, pblocks, timeout=120)
    D.call("canary", timeout=120)
    before_p, before = P.call("counters"), D.call("counters")
    key, tid = f"lw-gpu-{i}", f"lw-gpu-xfer-{i}-{decoder}"
    if order == "reg_first":
        D.call("expect_at", key, tid, 0, P.call("address"), dblocks, 0, num_tokens)
    P.call("stream_prefill", key, tid, pblocks, num_tokens, delay_cycles=2_000_000,
           timeout=120)
    if order != "reg_first":
        D.call("expect_at", key, tid, 0, P.call("address"), dblocks, 0, num_tokens)
    got = D.call("outcome_at", key, 60.0, timeout=90)
    assert got is not None and got[0] == "received", got
    assert P.call("wait_released", [key], 30.0) == [key]
    v = D.call("verify", seed, num_tokens, dblocks, 0, timeout=120)
    assert v["mismatch"] == 0, f"{v['mismatch']} received elements differ from the pattern"
    assert v["canary"] == 0, f"{v['canary']} elements outside the target were overwritten"
    after_p, after = P.call("counters"), D.call("counters")
    dp = {k: after_p.get(k, 0) - before_p.get(k, 0) for k in after_p}
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert dp.get("layerwise_streams") == dp.get("layerwise_transfers") == 1, dp
    assert d.get("staged_transfers") == 1 and d.get("staged_chunks") == LAYERS, d
    assert P.call("live")["staging_rooms"] == 0 and P.call("live")["streams"] == 0
    figures("gpu layer-wise push (VRAM->VRAM)", f"{decoder} {order} {num_tokens} tok",
            "verified", f"{LAYERS} chunks")
