"""VRAM -> VRAM push between two processes on one CUDA GPU, bytes verified on the GPU.

A small version of ``benchmarks/bench_transfer_gpu.py``'s check, through the production path
(``describe_kv_caches(..., backend=CudaBackend())``, ``PushWorker``, NIXL UCX), with the peers'
torch memory from ``kv_push.common.testing.torch_pool``: one producer with
vLLM FlashAttention-shaped KV (per layer ``(2, num_blocks, 16, heads, head_size)`` bf16,
``kv_split``) pushes into decoders with block size 32 and ``blocks_first`` tensors
(``(num_blocks, 2, 32, heads, head_size)``), one token-major (NHD) and one head-major (HND, a
permuted view). P fills its blocks with a deterministic function of (seed, layer, K/V, token,
head, element) computed on the GPU; D fills its whole pool with a canary, and after ``received``
checks on the GPU every element of the target tokens against the function and every other
element of its pool against the canary.

Each case runs twice: with every process's layers as views of one allocation (``pool``) and with
one allocation per layer (``per_layer``, as vLLM allocates). ``per_layer`` once failed: adjacent
layer tensors were coalesced into one NIXL registration and UCX cuda_ipc maps only the
allocation holding a region's first byte (see docs/gpu.md); registrations and write regions now
stay within one layer's span.

Needs a CUDA GPU and the nixl package; skipped otherwise. ``KV_PUSH_TEST_DEVICE=cpu`` runs the
same check on host tensors (``HostBackend``), to debug it without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kv_push.common.layout import plan_writes
from kv_push.common.testing.block_ids import fragmented_blocks
from kv_push.common.testing.peer_process import LocalPeer, PeerSpec


def _device() -> str | None:
    forced = os.environ.get("KV_PUSH_TEST_DEVICE", "").strip()
    if forced:
        return forced
    try:
        import torch
    except ImportError:
        return None
    return "cuda" if torch.cuda.is_available() else None


DEVICE = _device()
HAVE_NIXL = importlib.util.find_spec("nixl") is not None

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.nixl,
    pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (torch.cuda.is_available())"),
    pytest.mark.skipif(not HAVE_NIXL, reason="needs the nixl package"),
]

LAYERS, HEADS, HEAD_SIZE = 4, 8, 128
P_BLOCKS, D_BLOCKS = 160, 96  # 2,560 tokens at 16, 3,072 at 32


def _spec(role: str, placement: str, order: str, block_size: int, blocks: int, alloc: str,
          **kw) -> PeerSpec:
    return PeerSpec(role=role, placement=placement, token_order=order, block_size=block_size,
                    num_blocks=blocks, num_layers=LAYERS, num_kv_heads=HEADS,
                    head_size=HEAD_SIZE, dtype_bytes=2, memory=f"torch:{DEVICE}", alloc=alloc,
                    config={"heartbeat_interval_s": 10.0, **kw.pop("config", {})}, **kw)


@pytest.fixture(scope="module", params=["pool", "per_layer"])
def peers(request):
    """P, D_nhd, D_hnd. ``pool``: each process's layers are views of one allocation;
    ``per_layer``: one allocation per layer, as vLLM allocates its KV cache."""
    alloc = request.param
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    # a producer refuses (NIXL_ERR_NOT_ALLOWED) a second decoder whose agent name collides with
    # one it already loaded; PushWorker names its agent "kvpush-<engine_id>-r<rank>-<random>",
    # so names never collide, and distinct engine ids keep the logs readable
    specs = {
        "P": _spec("producer", "kv_split", "NHD", 16, P_BLOCKS, alloc,
                   engine_id="prefill-gpu-test", config={"side_channel_port": 0}),
        "D_nhd": _spec("decoder", "blocks_first", "NHD", 32, D_BLOCKS, alloc,
                       engine_id="nhd-decode-gpu-test"),
        "D_hnd": _spec("decoder", "blocks_first", "HND", 32, D_BLOCKS, alloc,
                       engine_id="hnd-decode-gpu-test"),
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
        started["alloc"] = alloc
        yield started
    finally:
        started.pop("alloc", None)
        for k in ("D_nhd", "D_hnd", "P"):
            started[k].close()


_seq = iter(range(10_000))


@pytest.mark.parametrize("decoder,num_tokens,first_token", [
    ("D_nhd", 1000, 0),    # kv_split bs16 NHD -> blocks_first bs32 NHD, partial last blocks
    ("D_hnd", 1000, 0),    # -> blocks_first bs32 HND (head-major permuted view): per-vector
    ("D_nhd", 2049, 64),   # prefix hit: D already holds tokens [0, 64)
])
def test_vram_push_bytes_verified(peers, figures, decoder, num_tokens, first_token):
    P, D = peers["P"], peers[decoder]
    pinfo, dinfo = P.call("info"), D.call("info")
    pgeo, dgeo = P.call("geometry"), D.call("geometry")
    if DEVICE == "cuda":
        assert pinfo["backend"] == dinfo["backend"] == "cuda"
        assert pgeo.mem_type == dgeo.mem_type == "VRAM"
    assert pgeo.block_size == 16 and dgeo.block_size == 32
    assert pgeo.block_stride == pgeo.block_bytes  # kv_split
    assert dgeo.block_stride == 2 * dgeo.block_bytes  # blocks_first
    assert dgeo.token_order == ("HND" if decoder == "D_hnd" else "NHD")

    i = next(_seq)
    rng = np.random.default_rng(100 + i)
    pblocks = fragmented_blocks(rng, P_BLOCKS, -(-num_tokens // 16))
    dblocks = fragmented_blocks(rng, D_BLOCKS, -(-(num_tokens - first_token) // 32))
    seed = 5000 + i
    plan = plan_writes(pgeo, pblocks, dgeo, dblocks, first_token=first_token,
                       num_tokens=num_tokens)
    P.call("fill", seed, num_tokens, pblocks, timeout=120)
    D.call("canary", timeout=120)
    key, tid = f"gpu-req-{i}", f"gpu-xfer-{i}-{decoder}"
    address = P.call("address")
    D.call("expect_at", key, tid, 0, address, dblocks, first_token, num_tokens)
    t0 = P.call("prefill_done_at", key, tid, pblocks, num_tokens)
    got = D.call("outcome_at", key, 60.0, timeout=90)
    assert got is not None, "no outcome on D within 60 s"
    kind, reason, t1 = got
    assert kind == "received", (kind, reason)
    assert P.call("wait_released", [key], 30.0) == [key]
    v = D.call("verify", seed, num_tokens, dblocks, first_token, timeout=120)
    assert v["mismatch"] == 0, f"{v['mismatch']} received elements differ from the pattern"
    assert v["canary"] == 0, f"{v['canary']} elements outside the target were overwritten"
    # the check is not vacuous: another request's pattern does not match
    assert D.call("verify", seed + 1, num_tokens, dblocks, first_token, timeout=120)["mismatch"] > 0
    want_bytes = LAYERS * 2 * (num_tokens - first_token) * HEADS * HEAD_SIZE * 2
    assert v["checked_bytes"] == want_bytes == plan.total_bytes
    c = P.call("counters")
    assert c.get("writes_posted", 0) >= 1 and c.get("transfers_failed", 0) == 0
    figures("gpu push (VRAM->VRAM)",
            f"{peers['alloc']} {decoder} {num_tokens - first_token} tok, "
            f"{plan.num_regions} regions", t1 - t0, f"{want_bytes / 2**20:.1f} MiB verified")


def test_pattern_differs_across_layers_kv_tokens_heads():
    """The check would catch misplaced vectors: the function differs along every axis."""
    torch = pytest.importorskip("torch")
    from kv_push.common.testing.torch_pool import CANARY_D, TensorPattern, as_i16

    dev = torch.device("cuda" if DEVICE == "cuda" else "cpu")
    pat = TensorPattern(torch, dev, head_lo=0, heads=HEADS, head_size=HEAD_SIZE)
    a = pat.values(1, 0, 0, 0, 64)
    assert a.shape == (64, HEADS, HEAD_SIZE) and a.dtype == torch.int16
    assert torch.equal(a, pat.values(1, 0, 0, 0, 64))  # deterministic
    assert torch.equal(a[32:], pat.values(1, 0, 0, 32, 64))  # position-, not range-dependent
    others = [pat.values(2, 0, 0, 0, 64), pat.values(1, 1, 0, 0, 64), pat.values(1, 0, 1, 0, 64)]
    for o in others:
        assert (o != a).float().mean() > 0.99
    assert (a[1:] != a[:-1]).float().mean() > 0.99  # tokens
    assert (a[:, 1:] != a[:, :-1]).float().mean() > 0.99  # heads
    assert (a[..., 1:] != a[..., :-1]).float().mean() > 0.99  # elements
    assert (a == as_i16(CANARY_D)).float().mean() < 0.01
