"""The fused Triton staging kernels (kv_push.common.staging_triton) against the torch reference.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set per test) on CPU
tensors: the same kernel source, the same index math, the same cross-allocation addressing as on
the GPU (the interpreter loads and stores raw host addresses). Every case is checked two ways:

* end to end against the token-by-token reference (``test_staging.run_staged`` with
  ``kernel="triton"``: D's cache equals the reference, canaries and guards untouched), for all
  layouts, block sizes and TP directions (hypothesis and the worked examples);
* byte for byte against the torch ops: the packed staging bytes and the unpacked cache (the whole
  memory, guards included) are identical.

``cuda``-marked tests run the compiled kernels on a GPU. The selection (``select_kernels``,
env ``KV_PUSH_STAGING_KERNELS``) and the ``staging_launches{kernel}`` counter are checked too.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_push.common import staging_triton as ST
from kv_push.common.geometry import GeometryError
from kv_push.common.metrics import Counters
from kv_push.common.staged import StagingMemory, TorchStagingOps
from kv_push.common.staging import pack_plan, slot_layout, unpack_plans
from kv_push.common.staging_ops import CacheViews, DevicePlan, pack, unpack
from test_layout import Case, _case, cases, make_geo, pick_blocks, pool_size
from test_staging import CANARY, EXAMPLES, FAKE, SENTINEL, Mem, run_staged

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed in this venv")
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def interpret(monkeypatch):
    """Run the kernels in Triton's interpreter on CPU tensors (for this test only)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# -- selection ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value,device,want", [
    ("torch", "cuda", "torch"), ("torch", "cpu", "torch"), ("TORCH", "cpu", "torch"),
    ("auto", "cpu", "torch"), ("", "cpu", "torch"),
])
def test_select_kernels_values(value, device, want, monkeypatch) -> None:
    monkeypatch.setenv(ST.ENV, value)
    assert ST.select_kernels(device) == want
    assert ST.select_kernels(device, value) == want


@needs_triton
def test_select_kernels_auto_prefers_triton_on_cuda(monkeypatch) -> None:
    monkeypatch.delenv(ST.ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert ST.select_kernels("cuda") == "triton"
    assert ST.select_kernels("cpu") == "torch"  # auto never picks the interpreter
    monkeypatch.setenv(ST.ENV, "triton")
    assert ST.select_kernels("cuda") == "triton"
    with pytest.raises(ValueError, match="cannot run here"):
        ST.select_kernels("cpu")  # no interpreter: a clear error, not a silent fallback
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ST.select_kernels("cpu") == "triton"
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ST.select_kernels("cuda")  # the interpreter cannot address CUDA memory this way
    assert ST.select_kernels("cuda", "auto") == "torch"


def test_select_kernels_without_triton(monkeypatch) -> None:
    real = ST.importlib.import_module

    def no_triton(name, *a, **k):
        if name == "triton":
            raise ImportError("no triton here")
        return real(name, *a, **k)

    monkeypatch.setattr(ST.importlib, "import_module", no_triton)
    monkeypatch.setenv(ST.ENV, "auto")
    assert ST.select_kernels("cuda") == "torch"
    monkeypatch.setenv(ST.ENV, "triton")
    with pytest.raises(ValueError, match="triton does not import"):
        ST.select_kernels("cuda")


@pytest.mark.parametrize("bad", ["cuda", "fused", "1", "triton,torch"])
def test_select_kernels_rejects_bad_values(bad, monkeypatch) -> None:
    monkeypatch.setenv(ST.ENV, bad)
    with pytest.raises(ValueError, match=f"{ST.ENV}=.*expected one of auto, triton, torch"):
        ST.select_kernels("cuda")
    with pytest.raises(ValueError, match="expected one of"):
        TorchStagingOps(_geo(FAKE), StagingMemory(FAKE, 4096, "DRAM", 0))


def _geo(base, **kw):
    args = dict(placement="kv_split", order="NHD", block_size=16, num_blocks=8, tp=1, rank=0,
                layers=2, heads=2, head_size=4, dtype_bytes=2)
    args.update(kw)
    return make_geo(base=base, **args)


def test_ops_pick_the_env_kernel(monkeypatch) -> None:
    monkeypatch.setenv(ST.ENV, "torch")
    assert TorchStagingOps(_geo(FAKE), StagingMemory(FAKE, 4096, "DRAM", 0)).kernel == "torch"
    monkeypatch.setenv(ST.ENV, "auto")  # host memory: torch
    assert TorchStagingOps(_geo(FAKE), StagingMemory(FAKE, 4096, "DRAM", 0)).kernel == "torch"


# -- end to end against the token-by-token reference (interpreter) --------------------------


@needs_triton
@pytest.mark.parametrize("lpc", [1, 2])
@pytest.mark.parametrize("kw", EXAMPLES)
def test_triton_examples(kw, lpc, interpret) -> None:
    run_staged(_case(**kw), lpc, kernel="triton")


@needs_triton
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cases(), st.integers(1, 3))
def test_triton_matches_reference(interpret, c: Case, lpc: int) -> None:
    run_staged(c, lpc, kernel="triton")


@needs_triton
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cases(tp_change=True), st.integers(1, 3))
def test_triton_matches_reference_across_tp(interpret, c: Case, lpc: int) -> None:
    run_staged(c, lpc, kernel="triton")


# -- byte for byte against the torch ops -----------------------------------------------------


def compare_with_torch(c: Case, device: str = "cpu") -> dict:
    """Pack every writer with both kernels and unpack each result into a copy of D's cache with
    both kernels: all bytes (guards included) must be identical. Returns launch counts."""
    rng = np.random.default_rng(c.seed + 1)
    common = dict(layers=c.layers, heads=c.heads, head_size=c.head_size, dtype_bytes=c.dtype_bytes)
    cuda = device != "cpu"
    stream = torch.cuda.Stream(device) if cuda else None
    need_s = -(-c.num_tokens // c.src_bs)
    need_d = -(-(c.num_tokens - c.first_token) // c.dst_bs)
    d_nb = max(1, need_d + c.dst_extra)
    dkw = dict(placement=c.dst_place, order=c.dst_order, block_size=c.dst_bs, num_blocks=d_nb,
               tp=c.dst_tp, rank=c.dst_rank, **common)
    d_ids = pick_blocks(rng, d_nb, need_d + min(c.tail, d_nb - need_d), c.consecutive)
    d_n = pool_size(make_geo(base=FAKE, **dkw))
    d_init = rng.integers(0, 256, d_n, dtype=np.uint8)
    d_torch, d_triton = Mem(d_n, SENTINEL, device), Mem(d_n, SENTINEL, device)
    d_torch.load(d_init)
    d_triton.load(d_init)
    dst_t, dst_f = make_geo(base=d_torch.base, **dkw), make_geo(base=d_triton.base, **dkw)
    slot = slot_layout(dst_t, c.src_tp, first_token=c.first_token, num_tokens=c.num_tokens)
    s_nb = max(1, need_s + c.src_extra)
    launches = {"torch": 0, "triton": 0}
    src = None
    for w in slot.writers:
        skw = dict(placement=c.src_place, order=c.src_order, block_size=c.src_bs,
                   num_blocks=s_nb, tp=c.src_tp, rank=w.rank, **common)
        smem = Mem(pool_size(make_geo(base=FAKE, **skw)), 0, device)
        smem.load(rng.integers(0, 256, smem.n, dtype=np.uint8))
        src = make_geo(base=smem.base, **skw)
        s_ids = pick_blocks(rng, s_nb, need_s + min(c.tail, s_nb - need_s), c.consecutive)
        plan = pack_plan(src, s_ids, dst_t, first_token=c.first_token, num_tokens=c.num_tokens)
        if not w.length:
            continue
        a, b = Mem(w.length, CANARY, device), Mem(w.length, CANARY, device)
        ha = pack(CacheViews(src, device=device), DevicePlan(plan, device, stream=stream), a.body,
                  stream=stream)
        hb = ST.pack(ST.FusedPlan(plan, ST.FusedCache(src, device, stream=stream), stream=stream),
                     b.body, stream=stream)
        ha.synchronize()
        hb.synchronize()
        launches["torch"] += ha.launches
        launches["triton"] += hb.launches
        np.testing.assert_array_equal(a.t.cpu().numpy(), b.t.cpu().numpy(),
                                      err_msg="packed bytes differ")
        for dmem, dst, mine in ((d_torch, dst_t, False), (d_triton, dst_f, True)):
            splan = unpack_plans(src, dst, d_ids, first_token=c.first_token,
                                 num_tokens=c.num_tokens)[w.rank]
            if mine:
                h = ST.unpack(ST.FusedPlan(splan, ST.FusedCache(dst, device, stream=stream),
                                           stream=stream), b.body, stream=stream)
            else:
                h = unpack(CacheViews(dst, device=device), DevicePlan(splan, device,
                                                                      stream=stream),
                           a.body, stream=stream)
            h.synchronize()
    np.testing.assert_array_equal(d_torch.t.cpu().numpy(), d_triton.t.cpu().numpy(),
                                  err_msg="unpacked caches differ")
    return launches


@needs_triton
@pytest.mark.parametrize("kw", EXAMPLES)
def test_triton_equals_torch_examples(kw, interpret) -> None:
    got = compare_with_torch(_case(**kw))
    assert got["triton"] <= got["torch"]


@needs_triton
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.one_of(cases(), cases(tp_change=True)))
def test_triton_equals_torch(interpret, c: Case) -> None:
    compare_with_torch(c)


@needs_triton
def test_one_launch_per_chunk_and_counted(interpret) -> None:
    """The ops count launches in ``staging_launches{kernel}``: one per chunk for triton, one per
    (layer, part, segment) for torch; both fill the pool identically."""
    got = {}
    for kernel in ("torch", "triton"):
        rng = np.random.default_rng(3)
        geo_kw = dict(placement="kv_split", order="NHD", block_size=16, num_blocks=12, tp=1,
                      rank=0, layers=4, heads=2, head_size=8, dtype_bytes=2)
        mem = Mem(pool_size(make_geo(base=FAKE, **geo_kw)), 0)
        mem.load(rng.integers(0, 256, mem.n, dtype=np.uint8))
        src = make_geo(base=mem.base, **geo_kw)
        dst = make_geo(base=FAKE, **geo_kw)
        ids = [5, 2, 9, 0]  # 60 tokens from token 8: a partial block at each end
        plan = pack_plan(src, ids, dst, first_token=0, num_tokens=60)
        pool = Mem(plan.total_bytes, CANARY)
        counters = Counters()
        ops = TorchStagingOps(src, StagingMemory(pool.base, pool.n, "DRAM", 0), kernel=kernel,
                              counters=counters)
        prepared = ops.prepare(plan)
        half = plan.total_bytes // 2
        ops.pack(prepared, 0, half, range(0, 2), [None])
        ops.pack(prepared, half, half, range(2, 4), [None])
        got[kernel] = (counters.get("staging_launches", label=kernel), pool.host())
    assert got["triton"][0] == 2
    assert got["torch"][0] == 4 * 2 * len(plan.segments) and got["torch"][0] > 2
    np.testing.assert_array_equal(got["torch"][1], got["triton"][1])


@needs_triton
def test_fused_checks_its_arguments(interpret) -> None:
    geo_kw = dict(layers=2, heads=2, head_size=4, dtype_bytes=2)
    mem = Mem(pool_size(_geo(FAKE, **geo_kw)), 0)
    src = _geo(mem.base, **geo_kw)
    plan = pack_plan(src, [1, 3], _geo(FAKE, **geo_kw), first_token=0, num_tokens=20)
    fp = ST.FusedPlan(plan, ST.FusedCache(src, "cpu"))
    ok = Mem(plan.total_bytes, CANARY)
    with pytest.raises(GeometryError, match="holds"):
        ST.pack(fp, ok.body[:-2])
    with pytest.raises(GeometryError, match="gather plan"):
        ST.unpack(fp, ok.body)
    with pytest.raises(GeometryError, match="uint8"):
        ST.pack(fp, ok.body.view(torch.int16))
    with pytest.raises(GeometryError, match="stream"):
        ST.pack(fp, ok.body, stream=object())
    other = _geo(FAKE, layers=3, heads=2, head_size=4, dtype_bytes=2)
    with pytest.raises(GeometryError, match="another geometry"):
        ST.FusedPlan(plan, ST.FusedCache(other, "cpu"))
    h = ST.pack(fp, ok.body[:0], range(1, 1))
    assert h.query() and h.launches == 0


# -- on the GPU ----------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("kw", EXAMPLES)
def test_triton_examples_cuda(kw, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    run_staged(_case(**kw), 2, device="cuda:0", kernel="triton")


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("kw", EXAMPLES)
def test_triton_equals_torch_cuda(kw, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    compare_with_torch(_case(**kw), device="cuda:0")


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.one_of(cases(), cases(tp_change=True)), st.integers(1, 3))
def test_triton_matches_reference_cuda(monkeypatch, c: Case, lpc: int) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    run_staged(c, lpc, device="cuda:0", kernel="triton")
