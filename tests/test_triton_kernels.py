"""Each Triton kernel against its float32 `*_torch` oracle, plus the test-only interpreter patch.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py).
Shapes are tiny: the interpreter costs about a second per launch.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import triton

from moe_modular.activation import act_and_mul_torch
from moe_modular.config import Activation
from moe_modular.kernels.act_and_mul import IntermediateQuant, RowMode, act_and_mul
from moe_modular.kernels.moe_align import ALIGN_BLOCK, align_workspace_numel, moe_align, moe_align_torch
from moe_modular.kernels.gemm_config import (
    AScale,
    BatchedRows,
    BScale,
    GemmEpilogue,
    GemmScales,
    GemmTile,
    LaunchOptions,
    RouteRows,
    SortedRows,
)
from moe_modular.kernels.moe_gemm import gpu_has_tma, moe_gemm, moe_gemm_torch
from moe_modular.kernels.moe_sum import moe_sum, moe_sum_torch
from moe_modular.quant import FP8_DTYPE, QuantConfig, expand_group_scale, quantize_activations, quantize_weights

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
FP8_EPS = torch.finfo(FP8_DTYPE).eps


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def _expert_map(E: int, held: list[int]) -> torch.Tensor:
    m = torch.full((E,), -1, dtype=torch.int32)
    m[torch.tensor(held)] = torch.arange(len(held), dtype=torch.int32)
    return m.to(DEVICE)


# ---- moe_align --------------------------------------------------------------------------
# (T, k, El, BLOCK_M, map: None | "half" (every other global expert held) | "local-1" (EP local ids with -1)
#  | "skewed" (local ids, nine routes in ten on expert 5))
ALIGN_CASES = [
    (1, 1, 3, 16, None),  # M=1, topk=1: one route, one padded block
    (0, 2, 4, 16, None),  # M=0: no blocks, num_post_padded 0
    (7, 2, 13, 16, None),  # prime El, most experts empty
    (33, 4, 8, 32, "half"),  # expert_map with -1 experts: their routes get no slot
    (9, 3, 5, 16, "local-1"),  # local ids with -1 (routes held elsewhere)
    (100, 3, 7, 16, None),  # R = 300 > ALIGN_BLOCK: count and place launches, prefixes across chunks
    (70, 4, 6, 64, "half"),  # multi-chunk with a map and a wide block
    (300, 4, 9, 16, "half"),  # R = 1200: one route chunk per count chunk (below GROUPED_FROM chunks)
    (2100, 8, 16, 64, None),  # R = 16800: 132 route chunks in count chunks of COUNT_GROUP
    (150, 4, 256, 16, "skewed"),  # 256 bins: an expert's run of blocks spans several layout steps
    (20, 3, 256, 16, "skewed"),  # 256 bins in the one-program path
]


@pytest.mark.parametrize("T,k,El,block_m,kind", ALIGN_CASES)
def test_moe_align_matches_oracle(T, k, El, block_m, kind):
    g = _gen(T * 31 + El)
    E = 2 * El if kind == "half" else El
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32)
    emap = None
    if kind == "half":
        emap = _expert_map(E, list(range(0, E, 2)))
    elif kind == "local-1":
        ids[torch.rand(T, k, generator=g) < 0.3] = -1
    elif kind == "skewed":
        ids[torch.rand(T, k, generator=g) < 0.9] = 5
    # poisoned: every entry the oracle expects must be written
    buffers = {name: torch.full((n,), -7, dtype=torch.int32, device=DEVICE)
               for name, n in align_workspace_numel(T * k, El, block_m).items()}
    sorted_ids, block_expert, npp = moe_align(ids.to(DEVICE), block_m, El, emap, buffers=buffers)
    ref_sorted, ref_blocks, ref_n = moe_align_torch(ids, block_m, El, None if emap is None else emap.cpu())
    n = int(npp.item())
    assert n == ref_n
    assert torch.equal(sorted_ids[:n].cpu(), ref_sorted)
    assert torch.equal(block_expert[: n // block_m].cpu(), ref_blocks)
    assert bool((block_expert[n // block_m:] == -1).all())
    if T * k > ALIGN_BLOCK:
        assert n >= T * k // 2  # the multi-chunk path placed routes from every chunk


# ---- moe_gemm -------------------------------------------------------------------------------
GEMM_SCHEMES = [
    (torch.bfloat16, QuantConfig()),  # 16-bit, no scales
    (torch.float32, QuantConfig()),  # fp32 (ieee dot)
    (torch.bfloat16, QuantConfig.fp8_per_tensor()),  # scalar A scale, per-expert B scale
    (torch.bfloat16, QuantConfig.fp8_per_token()),  # per-row A scale, per-channel B scale
    (torch.bfloat16, QuantConfig.fp8_block((64, 32))),  # 1x32 groups, 64x32 blocks (K tile capped at 32)
]


def _gemm_inputs(T, K, E, No, dtype, qc, seed):
    g = _gen(seed)
    x = torch.randn(T, K, generator=g)
    w = torch.randn(E, No, K, generator=g) / K ** 0.5
    xq, xs = quantize_activations(x.to(dtype), qc)
    wq, ws = quantize_weights(w, qc)
    if not qc.is_quantized:
        wq = wq.to(dtype)
    return xq, xs, wq, ws


def _dense_scale(scale, qc, rows, cols, group):
    """An A scale broadcast to (rows, cols), or None."""
    if scale is None:
        return None
    if qc.is_block:
        return expand_group_scale(scale, cols, group)
    return scale.expand(rows, 1) if scale.numel() == 1 else scale


def _weight_scale(ws, qc, e, No, K):
    if ws is None:
        return None
    if qc.is_block:
        bn, bk = qc.block_shape
        return ws[e].repeat_interleave(bn, 0)[:No].repeat_interleave(bk, 1)[:, :K]
    if ws.dim() == 1:
        return ws[e]
    return ws[e]  # (No, 1)


_MODES = {"unquantized": (AScale.NONE, BScale.NONE), "fp8-tensor": (AScale.TENSOR, BScale.TENSOR),
          "fp8-token": (AScale.ROW, BScale.CHANNEL)}


# b_tma: weight tiles through a tensor descriptor (TMA on Hopper; the interpreter emulates it) or pointers
B_TMA = pytest.mark.parametrize("b_tma", [0, 1], ids=["b-ptr", "b-tma"])


@B_TMA
@pytest.mark.parametrize("dtype,qc", GEMM_SCHEMES, ids=lambda v: getattr(v, "name", str(v)))
def test_moe_gemm_standard_matches_oracle(dtype, qc, b_tma):
    # T=5 tokens, k=2, E=3 experts, K=80 (not a multiple of BLOCK_K=32/64), No=48 (not a multiple of BLOCK_N)
    T, k, E, K, No = 5, 2, 3, 80, 48
    xq, xs, wq, ws = _gemm_inputs(T, K, E, No, dtype, qc, seed=3)
    ids = torch.randint(0, E, (T, k), generator=_gen(4), dtype=torch.int32)
    topk_w = torch.rand(T, k, generator=_gen(5))
    tile = GemmTile(16, 32, 32 if qc.is_block else 64, 1, 4, 2)
    sorted_ids, block_expert, npp = moe_align(ids.to(DEVICE), tile.BLOCK_M, E)
    c = torch.full((T * k, No), float("nan"), dtype=dtype, device=DEVICE)
    a_mode, b_mode = _MODES.get(qc.name, (AScale.GROUP, BScale.BLOCK))
    scales = GemmScales(None if xs is None else xs.to(DEVICE), a_mode, None if ws is None else ws.to(DEVICE), b_mode,
                        qc.block_shape or (1, 1))
    moe_gemm(xq.to(DEVICE), wq.to(DEVICE), c, tile, SortedRows(sorted_ids, block_expert, npp, T * k, k), scales=scales,
             epilogue=GemmEpilogue(topk_weights_Tk=topk_w.to(DEVICE)), launch=LaunchOptions(b_tma=b_tma))
    a_s = _dense_scale(xs, qc, T, K, qc.group_size)
    for r in range(T * k):
        t, e = r // k, int(ids.view(-1)[r])
        ref = moe_gemm_torch(xq[t:t + 1], wq[e], None if a_s is None else a_s[t:t + 1],
                             _weight_scale(ws, qc, e, No, K)) * topk_w.view(-1)[r]
        tol = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
        assert _rel(c[r].cpu(), ref[0]) <= tol, f"route {r}"


@pytest.mark.parametrize("T,kind", [(1, None), (1, "map"), (4, "local-1")], ids=["T1", "T1-map", "T4-local-1"])
def test_moe_gemm_per_route_blocks_match_oracle(T, kind):
    # One block per route, no alignment: route r's row only, its expert straight from the topk ids
    # (mapped by expert_map). T=4 hits some experts twice (their weights read twice, same values);
    # routes not held here (-1, mapped to -1, or a local id >= El) write nothing.
    k, El, K, No = 3, 4, 64, 48
    g = _gen(31 + T)
    E = 2 * El if kind == "map" else El
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    emap = _expert_map(E, [0, 2, 4, 6]) if kind == "map" else None
    if kind == "local-1":
        ids[0, 0], ids[1, 2] = -1, El  # held elsewhere / outside [0, El)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(El, No, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    topk_w = torch.rand(T, k, generator=g)
    c = torch.full((T * k, No), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    moe_gemm(x.to(DEVICE), w.to(DEVICE), c, GemmTile(16, 32, 32, 1, 4, 2), RouteRows(ids.to(DEVICE), T * k, k, emap),
             epilogue=GemmEpilogue(topk_weights_Tk=topk_w.to(DEVICE)))
    c = c.cpu()
    local = ids.view(-1).long() if emap is None else emap.cpu().long()[ids.view(-1).long()]
    held = 0
    for r in range(T * k):
        e = int(local[r])
        if not 0 <= e < El:
            assert c[r].isnan().all(), f"route {r} is not held here but was written"
            continue
        held += 1
        ref = moe_gemm_torch(x[r // k: r // k + 1], w[e]) * topk_w.view(-1)[r]
        assert _rel(c[r: r + 1], ref) <= 2 * torch.finfo(torch.bfloat16).eps, f"route {r}"
    assert held >= 1  # something was computed
    with pytest.raises(ValueError, match=r"RouteRows.topk_ids_Tk must be contiguous, got strides"):
        moe_gemm(x.to(DEVICE), w.to(DEVICE), c.to(DEVICE), GemmTile(16, 32, 32),
                 RouteRows(torch.cat([ids, ids], dim=1).to(DEVICE)[:, ::2], T * k, k))  # (T, k), column stride 2
    with pytest.raises(ValueError, match=r"rows \(dict\) must be one of \['SortedRows', 'RouteRows', 'BatchedRows'\]"):
        moe_gemm(x.to(DEVICE), w.to(DEVICE), c.to(DEVICE), GemmTile(16, 32, 32), dict(topk_ids_Tk=ids.to(DEVICE)))


def test_moe_gemm_b_tma_falls_back_to_pointers_where_tma_cannot_address_the_weights():
    # weights whose K stride is not 1 (a transposed copy): no descriptor; b_tma=1 then computes exactly
    # what the pointer path computes
    from moe_modular.kernels.moe_gemm import _descriptor

    T, k, E, K, No = 5, 2, 3, 64, 48
    g = _gen(11)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(E, K, No, generator=g) / K ** 0.5).to(torch.bfloat16).to(DEVICE).transpose(1, 2)  # (E, No, K)
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32).to(DEVICE)
    tile = GemmTile(16, 32, 32, 1, 4, 2)
    box = [1, tile.BLOCK_N, tile.BLOCK_K]
    assert _descriptor(w, box) is None and _descriptor(w.contiguous(), box) is not None
    sorted_ids, block_expert, npp = moe_align(ids, tile.BLOCK_M, E)
    outs = []
    for b_tma in (1, 0):
        c = torch.full((T * k, No), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        moe_gemm(x, w, c, tile, SortedRows(sorted_ids, block_expert, npp, T * k, k), launch=LaunchOptions(b_tma=b_tma))
        outs.append(c.cpu())
    assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("persistent", [0, 2], ids=["tiles", "persistent-ignored"])
@pytest.mark.parametrize("b_tma,a_tma", [(0, 0), (1, 0), (1, 1)], ids=["ptr", "b-tma", "ab-tma"])
@pytest.mark.parametrize("dtype,qc", [GEMM_SCHEMES[0], GEMM_SCHEMES[3], GEMM_SCHEMES[4]],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_moe_gemm_batched_matches_oracle_and_leaves_unused_slots(dtype, qc, b_tma, a_tma, persistent):
    # El=3 experts with counts (0, 5, 17): an empty expert and one spanning two 16-row blocks; the
    # batched format ignores tile.persistent (a program per tile either way)
    El, B, K, No = 3, 17, 80, 40
    counts = torch.tensor([0, 5, 17], dtype=torch.int32)
    xq, xs, wq, ws = _gemm_inputs(El * B, K, El, No, dtype, qc, seed=6)
    a = xq.view(El, B, K)
    a_scale = None if xs is None else xs.view(El, B, -1)
    c = torch.full((El, B, No), float("nan"), dtype=dtype, device=DEVICE)
    tile = GemmTile(16, 32, 32 if qc.is_block else 64, 1, 4, 2)
    a_mode, b_mode = _MODES.get(qc.name, (AScale.GROUP, BScale.BLOCK))
    scales = GemmScales(None if a_scale is None else a_scale.to(DEVICE), a_mode, None if ws is None else ws.to(DEVICE),
                        b_mode, qc.block_shape or (1, 1))
    moe_gemm(a.to(DEVICE), wq.to(DEVICE), c, tile, BatchedRows(counts.to(DEVICE)), scales=scales,
             launch=LaunchOptions(b_tma, a_tma, persistent))
    c = c.cpu()
    a_s = _dense_scale(xs, qc, El * B, K, qc.group_size)
    for e in range(El):
        n = int(counts[e])
        if n:
            rows = slice(e * B, e * B + n)
            ref = moe_gemm_torch(xq[rows], wq[e], None if a_s is None else a_s[rows], _weight_scale(ws, qc, e, No, K))
            assert _rel(c[e, :n], ref) <= 2 * torch.finfo(dtype).eps
        assert bool(c[e, n:].isnan().all()), f"expert {e} wrote slots past its count"


# ---- act_and_mul ----------------------------------------------------------------------------
def test_act_blocks_spread_small_batches_over_the_gpu():
    from moe_modular.kernels.act_and_mul import TARGET_PROGRAMS, act_blocks
    from moe_modular.kernels.host import cdiv

    for R, N in ((8, 768), (16, 2048), (64, 14336), (8192, 768), (131072, 2048)):
        for quant in IntermediateQuant:
            br, bn, cols = act_blocks(R, N, quant, 128, True)
            programs = cdiv(R, br) * cdiv(N, cols)
            assert cols % bn == 0 and br >= 1
            if quant is IntermediateQuant.GROUP:
                assert bn == 128
            if quant is IntermediateQuant.TOKEN:
                assert cols >= N, "per-token scales need whole rows in one program"
            # enough programs, or nothing left to split
            assert programs >= TARGET_PROGRAMS or (br == 1 and (cols == bn or quant is IntermediateQuant.TOKEN)), \
                (R, N, quant, br, bn, cols)
    assert act_blocks(131072, 768, IntermediateQuant.GROUP, 128, True)[2] == 768  # enough rows: whole rows


# (activation, quant, N): N=40 is not a multiple of the 32-wide groups / column tiles
ACT_CASES = [
    (Activation.SILU, IntermediateQuant.NONE, 40),
    (Activation.GELU, IntermediateQuant.NONE, 40),
    (Activation.SWIGLU_OAI, IntermediateQuant.NONE, 40),  # interleaved gate/up with clamps
    (Activation.SILU, IntermediateQuant.TENSOR_STATIC, 40),
    (Activation.SILU, IntermediateQuant.TENSOR_DYNAMIC, 40),  # one scale for all rows (RowMode.ALL)
    (Activation.SWIGLU_OAI, IntermediateQuant.TOKEN, 40),
    (Activation.GELU, IntermediateQuant.GROUP, 40),
]

_ORACLE_QUANT = {IntermediateQuant.TENSOR_STATIC: QuantConfig.fp8_per_tensor(static=True),
                 IntermediateQuant.TENSOR_DYNAMIC: QuantConfig.fp8_per_tensor(),
                 IntermediateQuant.TOKEN: QuantConfig.fp8_per_token(),
                 IntermediateQuant.GROUP: QuantConfig.fp8_block((32, 32))}


def _gpu_act_blocks(monkeypatch):
    """Make act_and_mul launch with the blocks a GPU picks (rows and columns split over many programs)."""
    from moe_modular.kernels import act_and_mul as act_module

    real = act_module.act_blocks
    monkeypatch.setattr(act_module, "act_blocks", lambda R, N, quant, group, gpu: real(R, N, quant, group, True))


@pytest.mark.parametrize("blocks", ["launch", "gpu"])
@pytest.mark.parametrize("activation,quant,N", ACT_CASES, ids=lambda v: getattr(v, "value", str(v)))
def test_act_and_mul_matches_oracle(activation, quant, N, blocks, monkeypatch):
    if blocks == "gpu":
        _gpu_act_blocks(monkeypatch)
    R = 6
    x = (torch.randn(R, 2 * N, generator=_gen(7)) * 3).to(torch.bfloat16)
    x[0, :] = 0.0  # an all-zero row: the minimum amax keeps its scale finite
    ref = act_and_mul_torch(x, activation)
    static = (ref.abs().max() / 300).reshape(1)  # a static scale that does not saturate
    out = torch.full((R, N), float("nan"), device=DEVICE).to(
        torch.bfloat16 if quant is IntermediateQuant.NONE else FP8_DTYPE)
    out, scale = act_and_mul(x.to(DEVICE), activation, out, quant=quant, group_size=32,
                             scale=static.to(DEVICE) if quant is IntermediateQuant.TENSOR_STATIC else None)
    if quant is IntermediateQuant.NONE:
        assert _rel(out.cpu(), ref) <= 2 * torch.finfo(torch.bfloat16).eps
        return
    qc = _ORACLE_QUANT[quant]
    ref_q, ref_s = quantize_activations(ref, qc, static)
    if quant is IntermediateQuant.TENSOR_DYNAMIC:
        scale = scale[:1]
    assert torch.allclose(scale.cpu(), ref_s, rtol=1e-6, atol=0)
    same = (out.cpu().view(torch.uint8) == ref_q.view(torch.uint8)).float().mean().item()
    assert same >= 0.97, f"only {same:.3f} of the fp8 bytes match the oracle"
    deq = out.cpu().float() * (expand_group_scale(scale.cpu(), N, 32) if quant is IntermediateQuant.GROUP
                               else scale.cpu())
    assert _rel(deq, ref_q.float() * (expand_group_scale(ref_s, N, 32) if quant is IntermediateQuant.GROUP
                                      else ref_s)) <= FP8_EPS / 4
    assert _rel(deq, ref) <= FP8_EPS


@pytest.mark.parametrize("blocks", ["launch", "gpu"])
def test_act_and_mul_routes_skip_rows_not_held_and_scale_per_expert(blocks, monkeypatch):
    # 4 tokens x topk 2 = 8 routes over El=2 local experts; expert_map sends global expert 2 nowhere
    if blocks == "gpu":
        _gpu_act_blocks(monkeypatch)
    T, k, N = 4, 2, 16
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]], dtype=torch.int32)
    emap = _expert_map(3, [0, 1])
    x = torch.randn(T * k, 2 * N, generator=_gen(8)).to(torch.bfloat16)
    x[1] = float("nan")  # route 1 goes to the unheld expert 2: never read
    out = torch.full((T * k, N), float("nan"), dtype=FP8_DTYPE, device=DEVICE)
    out, scale = act_and_mul(x.to(DEVICE), Activation.SILU, out, quant=IntermediateQuant.TENSOR_DYNAMIC,
                             row_mode=RowMode.ROUTES, topk_ids_Tk=ids.to(DEVICE), expert_map_E=emap,
                             num_local_experts=2)
    out, scale = out.cpu(), scale.cpu()
    h = act_and_mul_torch(x, Activation.SILU)
    local = emap.cpu().long()[ids.view(-1).long()]
    for e in (0, 1):
        rows = (local == e).nonzero().squeeze(1)
        ref_q, ref_s = quantize_activations(h[rows], QuantConfig.fp8_per_tensor())
        assert torch.allclose(scale[e:e + 1], ref_s, rtol=1e-6, atol=0)
        assert _rel(out[rows].float() * scale[e], h[rows]) <= FP8_EPS
    assert bool(out[1].float().isnan().all()), "a route not held here was written"


# ---- moe_sum --------------------------------------------------------------------------------
@pytest.mark.parametrize("blocks", ["launch", "gpu"])
@pytest.mark.parametrize("T,k,K,kind", [
    (1, 1, 24, None),  # M=1, topk=1
    (5, 3, 300, "map"),  # K not a multiple of the block; expert_map -1 experts
    (6, 2, 40, "local-1"),  # local ids with -1
    (37, 8, 200, None),  # topk 8, several token blocks
])
def test_moe_sum_ignores_routes_not_held(T, k, K, kind, blocks, monkeypatch):
    # blocks "gpu": the block sizes a GPU launch picks (small blocks for small batches), whatever the device
    from moe_modular.kernels import moe_sum as sum_module

    if blocks == "gpu":
        real = sum_module.sum_blocks
        monkeypatch.setattr(sum_module, "sum_blocks", lambda T, K, gpu: real(T, K, True))
    g = _gen(9)
    El = 3
    ids = torch.randint(0, 2 * El if kind == "map" else El, (T, k), generator=g, dtype=torch.int32)
    emap = _expert_map(2 * El, [0, 2, 4]) if kind == "map" else None
    if kind == "local-1":
        ids[0, 0] = -1
    y = torch.randn(T * k, K, generator=g).to(torch.bfloat16)
    held = ids.view(-1).long() if emap is None else emap.cpu().long()[ids.view(-1).long()]
    y[held < 0] = float("nan")  # rows of routes not held here hold garbage
    out = torch.full((T, K), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    moe_sum(y.to(DEVICE), ids.to(DEVICE), out, El, emap)
    ref = moe_sum_torch(y, ids, El, None if emap is None else emap.cpu())
    assert torch.isfinite(out).all()
    assert _rel(out.cpu(), ref) <= torch.finfo(torch.bfloat16).eps


def test_moe_sum_blocks_spread_small_batches_over_the_gpu():
    from moe_modular.kernels.host import cdiv
    from moe_modular.kernels.moe_sum import MAX_BLOCK, MIN_BLOCK, TARGET_PROGRAMS, sum_blocks

    for T, K in ((1, 2048), (8, 2048), (64, 7168), (16384, 2048)):
        bt, bk, warps = sum_blocks(T, K, True)
        programs, elems = cdiv(T, bt) * cdiv(K, bk), bt * bk
        assert MIN_BLOCK <= elems <= MAX_BLOCK and 1 <= warps <= 4
        assert programs >= TARGET_PROGRAMS or elems == MIN_BLOCK, (T, K, bt, bk)
        assert elems == MAX_BLOCK or cdiv(T * K, 2 * elems) < TARGET_PROGRAMS  # no smaller than it needs


@B_TMA
@pytest.mark.parametrize("activation", [Activation.SILU, Activation.GELU], ids=lambda a: a.value)
def test_moe_gemm_fused_activation_matches_oracle(activation, b_tma):
    # First GEMM with act(gate) * up in the epilogue: c (R, N) from b (El, 2N, K); rows grouped by
    # moe_align; the rows of unheld routes (id -1) are not written (NaN stays).
    T, k, El, K, N = 5, 2, 3, 96, 40
    g = _gen(7)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    b = (torch.randn(El, 2 * N, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    ids = torch.randint(0, El, (T, k), generator=g, dtype=torch.int32)
    ids[0, 1] = -1
    tile = GemmTile(16, 32, 32, 1, 4, 2)
    sorted_ids, block_expert, num_pp = moe_align(ids.to(DEVICE), tile.BLOCK_M, El, None)
    rows = SortedRows(sorted_ids, block_expert, num_pp, T * k, k)
    c = torch.full((T * k, N), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    moe_gemm(x.to(DEVICE), b.to(DEVICE), c, tile, rows, epilogue=GemmEpilogue(activation),
             launch=LaunchOptions(b_tma=b_tma))
    c = c.cpu()
    for r in range(T * k):
        e = int(ids.view(-1)[r])
        if e < 0:
            assert c[r].isnan().all()
            continue
        ref = act_and_mul_torch(moe_gemm_torch(x[r // k: r // k + 1], b[e]), activation)
        assert _rel(c[r: r + 1], ref) <= 2 * torch.finfo(torch.bfloat16).eps
    with pytest.raises(ValueError, match=r"GemmEpilogue.activation \(.*SWIGLU_OAI.*\) must be one of"):
        moe_gemm(x.to(DEVICE), b.to(DEVICE), c.to(DEVICE), tile, rows, epilogue=GemmEpilogue(Activation.SWIGLU_OAI))
    with pytest.raises(ValueError, match="even and c with 40 columns"):
        moe_gemm(x.to(DEVICE), b.to(DEVICE), torch.empty(T * k, 2 * N, device=DEVICE), tile, rows,
                 epilogue=GemmEpilogue(activation))


def test_moe_gemm_fused_activation_with_fp8_groups_matches_oracle():
    # fp8-block first GEMM (1 x 32 activation groups, 32 x 32 weight blocks) with act(gate) * up and the
    # 1 x 32 group quantization of the intermediate in its epilogue: c fp8 (R, N) plus its group scales.
    # N = 48: the second group of each 64-column tile is partial. Unheld routes (id -1): not written.
    T, k, El, K, N, G = 5, 2, 3, 96, 48, 32
    qc = QuantConfig.fp8_block((G, G))
    g = _gen(41)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    w = torch.randn(El, 2 * N, K, generator=g) / K ** 0.5
    xq, xs = quantize_activations(x, qc)
    wq, ws = quantize_weights(w, qc)
    ids = torch.randint(0, El, (T, k), generator=g, dtype=torch.int32)
    ids[1, 0] = -1
    tile = GemmTile(16, 64, 32, 1, 4, 2)
    sorted_ids, block_expert, num_pp = moe_align(ids.to(DEVICE), tile.BLOCK_M, El, None)
    c = torch.full((T * k, N), float("nan"), device=DEVICE).to(FP8_DTYPE)
    cs = torch.full((T * k, 2), float("nan"), device=DEVICE)
    rows = SortedRows(sorted_ids, block_expert, num_pp, T * k, k)
    scales = GemmScales(xs.to(DEVICE), AScale.GROUP, ws.to(DEVICE), BScale.BLOCK, (G, G))
    moe_gemm(xq.to(DEVICE), wq.to(DEVICE), c, tile, rows, scales=scales,
             epilogue=GemmEpilogue(Activation.SILU, c_scale=cs, c_group=G))
    c, cs = c.cpu().float(), cs.cpu()
    a_s = expand_group_scale(xs, K, G)
    for r in range(T * k):
        e = int(ids.view(-1)[r])
        if e < 0:
            assert c[r].isnan().all() and cs[r].isnan().all(), f"route {r} is not held but was written"
            continue
        t = r // k
        h1 = moe_gemm_torch(xq[t:t + 1], wq[e], a_s[t:t + 1], _weight_scale(ws, qc, e, 2 * N, K))
        ref = act_and_mul_torch(h1, Activation.SILU)[0]
        want_scale = torch.stack([ref[:G].abs().max(), ref[G:].abs().max()]) / torch.finfo(FP8_DTYPE).max
        assert torch.allclose(cs[r], want_scale, rtol=1e-2), f"route {r} scales"
        assert _rel(c[r] * expand_group_scale(cs[r], N, G), ref) <= FP8_EPS, f"route {r}"
    with pytest.raises(ValueError, match=r"GemmEpilogue.c_group \(64\) must be a power of two dividing tile.BLOCK_N "
                                         r"\(32\)"):
        moe_gemm(xq.to(DEVICE), wq.to(DEVICE), torch.empty(T * k, N, device=DEVICE).to(FP8_DTYPE),
                 GemmTile(16, 32, 32), rows, scales=scales,
                 epilogue=GemmEpilogue(Activation.SILU, c_scale=torch.empty(T * k, 1, device=DEVICE), c_group=64))


# Routes per expert for the persistent tests (BLOCK_M 16): two full blocks and a partial one, one partial
# block, exactly one full block, none.
PERSISTENT_COUNTS = [41, 9, 16, 0]


def _routes_with_counts(counts, k, g):
    """topk ids (T, k) whose routes hit expert e counts[e] times, in random order."""
    ids = torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in enumerate(counts)])
    return ids[torch.randperm(ids.numel(), generator=g)].view(-1, k)


def _check_chain(x, w1, w2, topk_w, ids, sorted_ids, num_pp, inter, y, activation, inter_sorted=True):
    """The two GEMMs of a chain against the oracle, route by route: the intermediate (sorted rows, or route
    rows) against act(x @ w1.T), the output (route rows) against the kernel's intermediate @ w2.T times the
    top-k weight; unheld routes (and padding rows of a sorted intermediate) left as NaN."""
    k = ids.shape[1]
    y, inter, sid, npp = y.cpu(), inter.cpu(), sorted_ids.cpu(), int(num_pp.cpu())
    eps = torch.finfo(x.dtype).eps
    for r in range(ids.numel()):
        e = int(ids.view(-1)[r])
        if e < 0:
            assert y[r].isnan().all()
            continue
        p = int((sid[:npp] == r).nonzero()) if inter_sorted else r
        h = act_and_mul_torch(moe_gemm_torch(x[r // k: r // k + 1], w1[e]), activation)
        assert _rel(inter[p: p + 1], h) <= 2 * eps, f"route {r} (expert {e}): intermediate"
        ref = moe_gemm_torch(inter[p: p + 1], w2[e]) * topk_w.view(-1)[r]
        assert _rel(y[r: r + 1], ref) <= 2 * eps, f"route {r} (expert {e}): output"
    if inter_sorted:
        assert inter[sid == ids.numel()].isnan().all(), "padding rows were written"


@pytest.mark.parametrize("persistent", [0, 2], ids=["tiles", "persistent"])
@pytest.mark.parametrize("a_tma", [0, 1], ids=["a-ptr", "a-tma"])
def test_moe_gemm_sorted_intermediate_chain_matches_oracle(a_tma, persistent):
    # The fused first GEMM writes the intermediate in sorted order (c_sorted); the second GEMM reads it
    # there (a_sorted, through a descriptor with a_tma) and writes routes, times the top-k weights; a
    # program per tile, or (persistent) a program per SM walking the tiles. Routing PERSISTENT_COUNTS.
    # Unheld routes (id -1) and padding rows: nothing written (NaN stays).
    k, El, K, N = 2, len(PERSISTENT_COUNTS), 96, 40
    g = _gen(17)
    ids = _routes_with_counts(PERSISTENT_COUNTS, k, g)
    ids[2, 0] = -1
    T = ids.shape[0]
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(El, 2 * N, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(El, K, N, generator=g) / N ** 0.5).to(torch.bfloat16)
    topk_w = torch.rand(T, k, generator=g)
    tile, launch = GemmTile(16, 32, 32, 2, 4, 2), LaunchOptions(1, a_tma, persistent)
    sorted_ids, block_expert, num_pp = moe_align(ids.to(DEVICE), tile.BLOCK_M, El, None)
    S = sorted_ids.numel()
    align = (sorted_ids, block_expert, num_pp, T * k)
    inter = torch.full((S, N), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    moe_gemm(x.to(DEVICE), w1.to(DEVICE), inter, tile, SortedRows(*align, a_row_div=k, c_sorted=True),
             epilogue=GemmEpilogue(Activation.SILU), launch=launch)
    y = torch.full((T * k, K), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    moe_gemm(inter, w2.to(DEVICE), y, tile, SortedRows(*align, a_sorted=True),
             epilogue=GemmEpilogue(topk_weights_Tk=topk_w.to(DEVICE)), launch=launch)
    _check_chain(x, w1, w2, topk_w, ids, sorted_ids, num_pp, inter, y, Activation.SILU)
    with pytest.raises(ValueError, match=rf"SortedRows.a_sorted needs a with sorted_ids_S.numel\(\) \(\d+\) rows, "
                                         rf"got {T * k}"):
        moe_gemm(inter[: T * k], w2.to(DEVICE), y.to(DEVICE), tile, SortedRows(*align, a_sorted=True), launch=launch)


# Routes per expert for the warp-specialized chain (BLOCK_M 64 / 128): full and partial blocks, a single
# route, none, a block exactly full.
WS_COUNTS = [150, 1, 0, 128, 301]


@pytest.mark.skipif(not gpu_has_tma(DEVICE), reason="the warp-specialized Gluon kernel needs a Hopper-class GPU "
                    "(Triton's interpreter does not run Gluon); elsewhere LaunchOptions.ws runs the Triton kernel")
@pytest.mark.parametrize("activation", [Activation.SILU, Activation.GELU], ids=lambda a: a.value)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_m,num_warps", [(128, 8), (64, 4)], ids=["m128w8", "m64w4"])
@pytest.mark.parametrize("gemm1_block_n", [32, 64])
@pytest.mark.parametrize("gather", [False, True], ids=["sorted", "gathered"])
def test_moe_gemm_ws_chain_matches_oracle(gather, gemm1_block_n, block_m, num_warps, dtype, activation, monkeypatch):
    # The warp-specialized kernel for both GEMMs (counted), with A in sorted order or gathered by the kernel.
    # Sorted: tokens sorted (sort_rows), the fused first GEMM writes the intermediate in sorted order, the
    # second reads it there; N and K are not multiples of the tiles (the weight boxes read past an expert's
    # rows and TMA pads K). Gathered (whole K tiles): the first GEMM reads token rows, the second route
    # rows of an intermediate in route order. Both write routes times the top-k weights. Unheld routes and
    # padding rows: nothing written (NaN stays).
    from moe_modular.kernels import moe_gemm_ws
    from moe_modular.kernels.sort_rows import sort_rows

    calls = []
    real = moe_gemm_ws.moe_gemm_ws
    monkeypatch.setattr(moe_gemm_ws, "moe_gemm_ws", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    k, El, K, N = (2, len(WS_COUNTS), 256, 128) if gather else (2, len(WS_COUNTS), 200, 136)
    g = _gen(83)
    ids = _routes_with_counts(WS_COUNTS, k, g)
    ids[3, 1] = -1
    T = ids.shape[0]
    x = torch.randn(T, K, generator=g).to(dtype)
    w1 = (torch.randn(El, 2 * N, K, generator=g) / K ** 0.5).to(dtype)
    w2 = (torch.randn(El, K, N, generator=g) / N ** 0.5).to(dtype)
    topk_w = torch.rand(T, k, generator=g)
    tile, launch = GemmTile(block_m, gemm1_block_n, 64, 4, num_warps, 3), LaunchOptions(b_tma=1, a_tma=1, ws=1)
    sorted_ids, block_expert, num_pp = moe_align(ids.to(DEVICE), tile.BLOCK_M, El, None)
    S = sorted_ids.numel()
    align = (sorted_ids, block_expert, num_pp, T * k)
    if gather:
        xs = x.to(DEVICE)
    else:
        xs = sort_rows(x.to(DEVICE), sorted_ids, num_pp, k, torch.full((S, K), float("nan"), dtype=dtype,
                                                                         device=DEVICE))
    inter = torch.full((T * k if gather else S, N), float("nan"), dtype=dtype, device=DEVICE)
    moe_gemm(xs, w1.to(DEVICE), inter, tile, SortedRows(*align, k, a_sorted=not gather, c_sorted=not gather),
             epilogue=GemmEpilogue(activation), launch=launch)
    y = torch.full((T * k, K), float("nan"), dtype=dtype, device=DEVICE)
    moe_gemm(inter, w2.to(DEVICE), y, replace(tile, BLOCK_N=128), SortedRows(*align, a_sorted=not gather),
             epilogue=GemmEpilogue(topk_weights_Tk=topk_w.to(DEVICE)), launch=launch)
    assert len(calls) == 2, "a GEMM ran the Triton kernel"
    _check_chain(x, w1, w2, topk_w, ids, sorted_ids, num_pp, inter, y, activation, inter_sorted=not gather)


def test_gluon_kernels_run_only_on_the_triton_they_were_checked_on():
    from moe_modular.kernels import host

    host.gluon_kernels_enabled.cache_clear()
    try:
        assert host.gluon_kernels_enabled("3.6.0") and host.gluon_kernels_enabled("3.6.1+git")
        with pytest.warns(RuntimeWarning, match=r"checked on Triton \['3.6'\]; Triton 3.9.0 runs the Triton kernel"):
            assert not host.gluon_kernels_enabled("3.9.0")
    finally:
        host.gluon_kernels_enabled.cache_clear()


def test_gpu_has_tma_reads_the_capability_once_per_gpu(monkeypatch):
    # asked on every launch: the capability of each GPU is read once (a device without an index is the
    # current one); CPU devices never ask
    from moe_modular.kernels import host

    calls = []
    capability = {0: (9, 0), 1: (8, 6)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: calls.append(i) or capability[i])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    host._capability_major.cache_clear()
    try:
        assert host.gpu_has_tma(torch.device("cuda", 0)) and host.gpu_has_tma(torch.device("cuda", 0))
        assert not host.gpu_has_tma(torch.device("cuda")) and not host.gpu_has_tma(torch.device("cuda", 1))
        assert not host.gpu_has_tma(torch.device("cpu"))
        assert calls == [0, 1]
    finally:
        host._capability_major.cache_clear()


GLUON_CHECKED = pytest.mark.skipif(
    not __import__("moe_modular.kernels.host", fromlist=["x"]).gluon_kernels_enabled(triton.__version__),
    reason="the Gluon kernels are checked on Triton 3.6 only (moe_modular.kernels.host.GLUON_CHECKED_TRITON); "
           "elsewhere LaunchOptions.ws runs the Triton kernel")


def _sm90_compile_check(*args) -> dict:
    """tests/sm90_compile_check.py's JSON for `args`, run in a process of its own: kernels run in Triton's
    interpreter earlier in this one leave triton.language patched, and the compile then fails."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "tests.sm90_compile_check", *map(str, args)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "0"},
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("per_route,persistent", [(True, 0), (False, 0), (False, 2)],
                         ids=["per-route", "tiles", "persistent"])
def test_moe_gemm_pdl_compiles_to_griddepcontrol(per_route, persistent):
    # tile.pdl cannot run in Triton's interpreter: compile the second GEMM for sm_90a (no GPU needed) and check
    # that it launches as a programmatic dependent, waits for the kernel before it once and lets the next one
    # be placed once.
    got = _sm90_compile_check("pdl", int(per_route), persistent)
    assert got == {"wait": 1, "launch_dependents": 1, "launch_pdl": True}, got


@pytest.mark.parametrize("fused,gather,tile", [
    (True, False, GemmTile(128, 128, 64, 8, 8, 4)),  # the tables' first GEMM: gate | up in one MMA, TMA rows
    (False, True, GemmTile(128, 128, 64, 8, 4, 4)),  # a second GEMM with one warpgroup, rows gathered
    (True, True, GemmTile(64, 32, 64, 4, 4, 3)),
], ids=["gemm1-sorted", "gemm2-gathered-4warps", "gemm1-gathered-64rows"])
@GLUON_CHECKED
def test_moe_gemm_ws_compiles_for_hopper(fused, gather, tile):
    # The Gluon kernel has no interpreter: compile it for sm_90a (no GPU needed) and check what it became:
    # wgmma instructions, cp.async only when gathering, shared memory within Hopper's 227 KiB, and (where
    # triton ships cuobjdump) no register spills.
    fields = [tile.BLOCK_M, tile.BLOCK_N, tile.BLOCK_K, tile.GROUP_M, tile.num_warps, tile.num_stages]
    got = _sm90_compile_check("ws", int(fused), int(gather), *fields)
    assert got["wgmma"]
    assert got["cp_async_arrive"] == gather
    assert got["shared"] <= 227 * 1024
    if got["local_bytes"] is not None:
        assert got["local_bytes"] == 0, got


@pytest.mark.parametrize("tile,message", [
    (GemmTile(32, 64, 64), r"LaunchOptions.ws needs BLOCK_M >= 64 .* got BLOCK_M 32, num_warps 4"),
    (GemmTile(64, 64, 64, num_warps=2), r"LaunchOptions.ws needs .* num_warps in \(4, 8\), got BLOCK_M 64, num_warps 2"),
])
def test_moe_gemm_ws_tile_errors_name_the_field(tile, message):
    ids = torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)
    sorted_ids, block_expert, npp = moe_align(ids, tile.BLOCK_M, 2)
    a = torch.zeros(sorted_ids.numel(), 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        moe_gemm(a, torch.zeros(2, 32, 64, dtype=torch.bfloat16, device=DEVICE),
                 torch.zeros(8, 32, dtype=torch.bfloat16, device=DEVICE), tile,
                 SortedRows(sorted_ids, block_expert, npp, 8, a_sorted=True), launch=LaunchOptions(ws=1))


@pytest.mark.parametrize("field,value,message", [
    ("ws", 2, r"LaunchOptions.ws \(2\) must be 0 or 1"),
    ("b_tma", -1, r"LaunchOptions.b_tma \(-1\) must be 0 or 1"),
    ("persistent", 3, r"LaunchOptions.persistent \(3\) must be one of \(0, 1, 2\)"),
])
def test_launch_options_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        LaunchOptions(**{field: value})


def test_gemm_scales_are_given_exactly_where_their_mode_says():
    a, b = torch.zeros(2, 4, 32, device=DEVICE), torch.zeros(2, 16, 32, device=DEVICE)
    c, rows = torch.zeros(2, 4, 16, device=DEVICE), BatchedRows(torch.ones(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"GemmScales.a \(None\) must be given exactly where GemmScales.a_mode "
                                         r"\(ROW\) is not NONE"):
        moe_gemm(a, b, c, GemmTile(16, 16, 32), rows, scales=GemmScales(None, AScale.ROW))
    with pytest.raises(ValueError, match=r"GemmScales.b \(\(2, 1\)\) must be given exactly where GemmScales.b_mode "
                                         r"\(NONE\) is not NONE"):
        moe_gemm(a, b, c, GemmTile(16, 16, 32), rows, scales=GemmScales(b=torch.ones(2, 1, device=DEVICE)))
    assert GemmScales(torch.ones(1), AScale.TENSOR, torch.ones(2), BScale.TENSOR).scaled and not GemmScales().scaled


@pytest.mark.parametrize("persistent", [1, 2])
@pytest.mark.parametrize("dtype,qc", [GEMM_SCHEMES[0], GEMM_SCHEMES[3]], ids=lambda v: getattr(v, "name", str(v)))
def test_moe_gemm_persistent_matches_oracle(dtype, qc, persistent):
    # A program per SM (a few in the interpreter) walking the tiles of the filled blocks: the oracle's
    # result for every route.
    k, E, K, No = 2, len(PERSISTENT_COUNTS), 64, 48
    g = _gen(61 + persistent)
    ids = _routes_with_counts(PERSISTENT_COUNTS, k, g)
    T = ids.shape[0]
    xq, xs, wq, ws = _gemm_inputs(T, K, E, No, dtype, qc, seed=62)
    topk_w = torch.rand(T, k, generator=g)
    tile = GemmTile(16, 32, 32, 2, 4, 2)
    sorted_ids, block_expert, npp = moe_align(ids.to(DEVICE), tile.BLOCK_M, E)
    c = torch.full((T * k, No), float("nan"), dtype=dtype, device=DEVICE)
    a_mode, b_mode = _MODES[qc.name]
    scales = GemmScales(None if xs is None else xs.to(DEVICE), a_mode, None if ws is None else ws.to(DEVICE), b_mode)
    moe_gemm(xq.to(DEVICE), wq.to(DEVICE), c, tile, SortedRows(sorted_ids, block_expert, npp, T * k, k), scales=scales,
             epilogue=GemmEpilogue(topk_weights_Tk=topk_w.to(DEVICE)), launch=LaunchOptions(persistent=persistent))
    c = c.cpu()
    for r in range(T * k):
        t, e = r // k, int(ids.view(-1)[r])
        ref = moe_gemm_torch(xq[t:t + 1], wq[e], None if xs is None else xs[t:t + 1],
                             _weight_scale(ws, qc, e, No, K)) * topk_w.view(-1)[r]
        assert _rel(c[r], ref[0]) <= 2 * torch.finfo(dtype).eps, f"route {r} (expert {e})"


@pytest.mark.parametrize("T,k,El,K", [(9, 3, 5, 200), (1, 1, 4, 64), (0, 2, 3, 64)], ids=["T9", "T1", "T0"])
def test_sort_rows_gathers_the_routes_and_leaves_padding(T, k, El, K):
    from moe_modular.kernels.sort_rows import sort_rows, sort_rows_torch

    g = _gen(23)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, El, (T, k), generator=g, dtype=torch.int32)
    if T:
        ids[0, 0] = -1  # not held: no slot
    sorted_ids, _, npp = moe_align(ids.to(DEVICE), 16, El)
    out = torch.full((sorted_ids.numel(), K), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    sort_rows(x.to(DEVICE), sorted_ids, npp, k, out)
    out, npp = out.cpu(), int(npp.cpu())
    want = sort_rows_torch(x, sorted_ids.cpu(), npp, k)
    assert len(want) == (T * k - 1 if T else 0)
    for p in range(out.shape[0]):
        if p in want:
            assert torch.equal(out[p], want[p]), f"row {p}"
        else:
            assert out[p].isnan().all(), f"padding row {p} was written"
    wide = torch.empty(out.shape[0], K + 1, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=rf"out_SK \(\({out.shape[0]}, {K + 1}\), torch.bfloat16\) must be at least"):
        sort_rows(x.to(DEVICE), sorted_ids, torch.tensor([0], device=DEVICE), k, wide)


# ---- quant_fp8: the GPU path of quantize_activations ------------------------------------------
# (T, K, input dtype, scheme): K not a multiple of the group, a single row, no rows.
QUANT_CASES = [
    (5, 200, torch.bfloat16, QuantConfig.fp8_block((128, 128))),
    (3, 96, torch.float32, QuantConfig.fp8_block((128, 32))),
    (1, 160, torch.float16, QuantConfig.fp8_per_token()),
    (6, 130, torch.bfloat16, QuantConfig.fp8_per_token()),
    (4, 72, torch.bfloat16, QuantConfig.fp8_per_tensor(static=True)),
    (7, 100, torch.float32, QuantConfig.fp8_per_tensor()),
    (0, 64, torch.bfloat16, QuantConfig.fp8_per_token()),
]


@pytest.mark.parametrize("T,K,dtype,qc", QUANT_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_quantize_fp8_kernel_matches_torch_bit_for_bit(T, K, dtype, qc):
    from moe_modular.quant import _quantize_activations_triton

    g = _gen(T * 1000 + K)
    x = (torch.randn(T, K, generator=g) * torch.logspace(-3, 2, K)).to(dtype)
    if T > 1:
        x[1] = 0  # an all-zero row takes the minimum amax
    static = torch.tensor([0.0375]) if qc.static_activation_scale else None
    ref_q, ref_s = quantize_activations(x, qc, static, use_kernel=False)
    xd = x.to(DEVICE)
    q, s = _quantize_activations_triton(xd, qc, static.to(DEVICE) if static is not None else None)
    assert q.dtype == FP8_DTYPE and q.shape == ref_q.shape and s.shape == ref_s.shape
    assert torch.equal(s.cpu(), ref_s)
    assert torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    if DEVICE.type == "cuda":  # quantize_activations itself takes the kernel on CUDA tensors
        q2, s2 = quantize_activations(xd, qc, static.to(DEVICE) if static is not None else None)
        assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
        # and the torch path on CUDA tensors (the oracle's) gives the CPU's bits too
        q3, s3 = quantize_activations(xd, qc, static.to(DEVICE) if static is not None else None, use_kernel=False)
        assert torch.equal(s3.cpu(), ref_s) and torch.equal(q3.cpu().view(torch.uint8), ref_q.view(torch.uint8))


def test_quantize_fp8_rejects_bad_arguments():
    from moe_modular.kernels.quant_fp8 import Fp8Scaling, quantize_fp8

    x = torch.randn(2, 64).to(DEVICE)
    with pytest.raises(ValueError, match=r"group_size \(48\) must be a power of two"):
        quantize_fp8(x, Fp8Scaling.GROUP, group_size=48)
    with pytest.raises(ValueError, match="static_scale"):
        quantize_fp8(x, Fp8Scaling.STATIC)
    with pytest.raises(ValueError, match=r"2-D \(T, K\)"):
        quantize_fp8(x[0], Fp8Scaling.TOKEN)


# ---- the interpreter patch (tests/conftest.py) -----------------------------------------------
@pytest.mark.skipif(not INTERPRETED, reason="checks the CPU interpreter patch")
def test_interpreter_patch_rounds_like_the_gpu():
    import triton
    import triton.language as tl

    @triton.jit
    def _k(x_ptr, bf_ptr, f8_ptr, mul_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m)
        b = x.to(tl.bfloat16)
        tl.store(bf_ptr + offs, b, mask=m)
        tl.store(f8_ptr + offs, x.to(tl.float8e4nv), mask=m)
        tl.store(mul_ptr + offs, b * b, mask=m)  # bf16 arithmetic, rounded to bf16

    # 126.2 -> 128 in e4m3 (the carry into the exponent); 1 + 2^-8 + 2^-10 rounds up in bf16; 500
    # saturates to 448.
    x = torch.tensor([126.2, 1.0 + 2 ** -8 + 2 ** -10, -3.3, 500.0, 0.1])
    bf = torch.empty(5, dtype=torch.bfloat16)
    f8 = torch.empty(5, dtype=FP8_DTYPE)
    mul = torch.empty(5, dtype=torch.bfloat16)
    _k[(1,)](x, bf, f8, mul, 5, BLOCK=8)
    assert torch.equal(bf, x.to(torch.bfloat16))
    assert torch.equal(f8.float(), x.clamp(-448, 448).to(FP8_DTYPE).float())
    assert f8[0].item() == 128.0
    assert torch.equal(mul, (bf.float() * bf.float()).to(torch.bfloat16))


# ---- the fp8 warp-specialized kernel (moe_gemm_ws_fp8) ---------------------------------------------------
FP8_WS_TILE, FP8_WS_LAUNCH = GemmTile(128, 128, 128, 8, 8, 3), LaunchOptions(ws=1)
# The wide tile of a GEMM without an activation: 256 output columns in two halves of 128
FP8_WS_WIDE = replace(FP8_WS_TILE, BLOCK_N=256)


@pytest.mark.parametrize("fused,gather,scales,wide,stack", [
    (True, True, 0, False, 16),  # the first GEMM: token rows gathered, gate | up, SiLU and the 1 x 128 quantization
    (False, True, 0, False, 16),  # the second GEMM on an intermediate in route order, block scales
    (False, False, 0, False, 16),  # the second GEMM on a sorted intermediate (TMA rows)
    (False, True, 1, False, 16),  # per-token x per-channel scales
    (False, True, 0, True, 32),  # wide tiles (two 128-column halves), block scales
    (False, False, 0, True, 96),
    (False, True, 1, True, 16),  # wide tiles, per-token x per-channel scales
], ids=["gemm1-block", "gemm2-block-gathered", "gemm2-block-sorted", "gemm2-row", "gemm2-block-wide-gathered",
        "gemm2-block-wide-sorted", "gemm2-row-wide"])
@GLUON_CHECKED
def test_moe_gemm_ws_fp8_compiles_for_hopper(fused, gather, scales, wide, stack):
    # No interpreter runs Gluon: compile for sm_90a (no GPU needed) and check what it became: 4 wgmma per
    # 64 x 128 x 128 step, consumer and half (two halves fused or wide), cp.async only when gathering, shared
    # memory within Hopper's 227 KiB, few spilled words (`stack` bytes: the prologue's and the epilogue's; the
    # fused or wide consumer holds three 64 x 128 float32 tiles in its 224 or 232 registers), every named barrier
    # within one warpgroup (the two consumers meet only at mbarriers), and consumers raised to at least 224
    # registers.
    got = _sm90_compile_check("wsfp8", int(fused), int(gather), scales, int(wide))
    assert got["wgmma"] == (16 if fused or wide else 8), got
    assert got["cp_async_arrive"] == gather
    assert got["shared"] <= 227 * 1024
    if got["stack_bytes"] is not None:
        assert got["stack_bytes"] <= stack, got
    assert got["barrier_threads"] and max(got["barrier_threads"]) <= 128, got
    assert max(r for r in got["max_regs"] if r < 256) >= 224, got


def _fp8_ws_scales(G, **over):
    """fp8_ws_scales for a block-scaled second GEMM it takes, with `over` replacing some of its values (standard:
    sorted rows or the batched format; fused: SiLU and the output's 1 x c_group quantization in the epilogue)."""
    fp8 = torch.float8_e4m3fn
    El, No, Ko, R = 2, 256, 384, 40
    v = dict(tile=FP8_WS_TILE, ws=1, a=torch.empty(R, Ko, dtype=fp8), b_ENK=torch.empty(El, No, Ko, dtype=fp8),
             c=torch.empty(R, No, dtype=torch.bfloat16), standard=True,
             a_scale=torch.empty(R, Ko // 128), a_scale_mode=AScale.GROUP,
             b_scale=torch.empty(El, No // 128, Ko // 128), b_scale_mode=BScale.BLOCK, group_shape=(128, 128),
             fused=False, c_group=0)
    v.update(over)
    ids = torch.zeros(R, dtype=torch.int32)
    rows = SortedRows(ids, ids, ids[:1], R) if v["standard"] else BatchedRows(ids[:El])
    scales = GemmScales(v["a_scale"], v["a_scale_mode"], v["b_scale"], v["b_scale_mode"], v["group_shape"])
    epilogue = GemmEpilogue(Activation.SILU if v["fused"] else None, c_group=v["c_group"])
    return G.fp8_ws_scales(v["tile"], LaunchOptions(ws=v["ws"]), v["a"], v["b_ENK"], v["c"], rows, scales, epilogue)


def test_fp8_ws_scales_picks_the_kernel_only_where_it_applies(monkeypatch):
    # The fp8 kernel's applicability, read on the host (no GPU): each refusal falls back to the Triton kernel.
    from moe_modular.kernels import moe_gemm as G

    monkeypatch.setattr(G, "gpu_has_tma", lambda device: True)
    monkeypatch.setattr(G, "gluon_kernels_enabled", lambda version: True)
    fp8 = torch.float8_e4m3fn
    assert _fp8_ws_scales(G) == "BLOCK"
    assert _fp8_ws_scales(G, a_scale_mode=AScale.ROW, b_scale_mode=BScale.CHANNEL, a_scale=torch.empty(40, 1),
                          b_scale=torch.empty(2, 256, 1)) == "ROW"
    fused = dict(fused=True, c=torch.empty(40, 128, dtype=fp8), c_group=128)
    assert _fp8_ws_scales(G, **fused) == "BLOCK"
    assert _fp8_ws_scales(G, tile=FP8_WS_WIDE) == "BLOCK"
    refused = {
        "wide, fused": dict(fused, tile=FP8_WS_WIDE),
        "BLOCK_N 512": dict(tile=replace(FP8_WS_TILE, BLOCK_N=512)),
        "ws 0": dict(ws=0),
        "batched": dict(standard=False),
        "BLOCK_N 64": dict(tile=replace(FP8_WS_TILE, BLOCK_N=64)),
        "4 warps": dict(tile=replace(FP8_WS_TILE, num_warps=4)),
        "bf16 A": dict(a=torch.empty(40, 384, dtype=torch.bfloat16)),
        "per-tensor scales": dict(a_scale_mode=AScale.TENSOR, b_scale_mode=BScale.TENSOR),
        "64 x 64 blocks": dict(group_shape=(64, 64)),
        "Ko 200": dict(a=torch.empty(40, 200, dtype=fp8), b_ENK=torch.empty(2, 256, 200, dtype=fp8)),
        "fused, 16-bit output": dict(fused=True, c=torch.empty(40, 128, dtype=torch.bfloat16)),
        "fused, N 192": dict(fused=True, c=torch.empty(40, 192, dtype=fp8), c_group=128,
                             b_ENK=torch.empty(2, 384, 384, dtype=fp8)),
        "fused, per-row scales": dict(**fused, a_scale_mode=AScale.ROW, b_scale_mode=BScale.CHANNEL),
        "fp8 output unfused": dict(c=torch.empty(40, 256, dtype=fp8)),
        "B not contiguous": dict(b_ENK=torch.empty(2, 384, 256, dtype=fp8).transpose(1, 2)),
        "scales strided along K": dict(a_scale=torch.empty(3, 40).t()),
    }
    for what, over in refused.items():
        assert _fp8_ws_scales(G, **over) is None, what
    monkeypatch.setattr(G, "gluon_kernels_enabled", lambda version: False)
    assert _fp8_ws_scales(G) is None, "a Triton the Gluon kernels were not checked on"
    monkeypatch.setattr(G, "gluon_kernels_enabled", lambda version: True)
    monkeypatch.setattr(G, "gpu_has_tma", lambda device: False)
    assert _fp8_ws_scales(G) is None, "a GPU before Hopper"


# Routes per expert for the fp8 chain (BLOCK_M 128): two full blocks and a partial one, a single route, none,
# a block exactly full, a partial block.
FP8_WS_COUNTS = [301, 1, 0, 128, 150]


def _fp8_chain_inputs(qc, K, N, seed):
    k, El = 2, len(FP8_WS_COUNTS)
    g = _gen(seed)
    ids = _routes_with_counts(FP8_WS_COUNTS, k, g)
    ids[3, 1] = -1  # a route held elsewhere: nothing written
    T = ids.shape[0]
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    xq, xs = quantize_activations(x, qc)
    w1q, w1s = quantize_weights(torch.randn(El, 2 * N, K, generator=g) / K ** 0.5, qc)
    w2q, w2s = quantize_weights(torch.randn(El, K, N, generator=g) / N ** 0.5, qc)
    topk_w = torch.rand(T, k, generator=g)
    return ids, xq, xs, w1q, w1s, w2q, w2s, topk_w


@pytest.mark.skipif(not gpu_has_tma(DEVICE), reason="the fp8 warp-specialized Gluon kernel needs a Hopper-class GPU "
                    "(Triton's interpreter does not run Gluon); elsewhere LaunchOptions.ws runs the Triton kernel")
@pytest.mark.parametrize("tile2", [FP8_WS_TILE, FP8_WS_WIDE], ids=["gemm2-128", "gemm2-wide"])
@pytest.mark.parametrize("sorted_mid", [False, True], ids=["route-order", "sorted"])
@pytest.mark.parametrize("activation", [Activation.SILU, Activation.GELU], ids=lambda a: a.value)
def test_moe_gemm_ws_fp8_block_chain_matches_oracle(activation, sorted_mid, tile2, monkeypatch):
    # fp8-block (1 x 128 / 128 x 128): the first GEMM gathers token rows and writes act(gate) * up quantized in
    # 1 x 128 groups (route order, or sorted for the second GEMM to load through TMA); the second writes routes
    # times the top-k weights in bf16, in 128-column tiles or wide ones (256 columns; the last tile's second half
    # past K = 384). K = 384 (3 K steps), N = 256 (2 column tiles). Both GEMMs run the fp8 kernel (counted).
    # Unheld routes: nothing written (NaN stays); intermediate padding rows too.
    from moe_modular.kernels import moe_gemm_ws_fp8

    calls = []
    real = moe_gemm_ws_fp8.moe_gemm_ws_fp8
    monkeypatch.setattr(moe_gemm_ws_fp8, "moe_gemm_ws_fp8", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    K, N, G = 384, 256, 128
    qc = QuantConfig.fp8_block((G, G))
    ids, xq, xs, w1q, w1s, w2q, w2s, topk_w = _fp8_chain_inputs(qc, K, N, seed=91)
    T, k = ids.shape
    R = T * k
    sorted_ids, block_expert, num_pp = moe_align(ids.to(DEVICE), FP8_WS_TILE.BLOCK_M, len(FP8_WS_COUNTS), None)
    S = sorted_ids.numel()
    align = (sorted_ids, block_expert, num_pp, R)
    rows = S if sorted_mid else R
    inter = torch.full((rows, N), float("nan"), device=DEVICE).to(FP8_DTYPE)
    inter_s = torch.full((rows, N // G), float("nan"), device=DEVICE)
    moe_gemm(xq.to(DEVICE), w1q.to(DEVICE), inter, FP8_WS_TILE, SortedRows(*align, k, c_sorted=sorted_mid),
             scales=GemmScales(xs.to(DEVICE), AScale.GROUP, w1s.to(DEVICE), BScale.BLOCK, (G, G)),
             epilogue=GemmEpilogue(activation, c_scale=inter_s, c_group=G), launch=FP8_WS_LAUNCH)
    y = torch.full((R, K), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    moe_gemm(inter, w2q.to(DEVICE), y, tile2, SortedRows(*align, a_sorted=sorted_mid),
             scales=GemmScales(inter_s, AScale.GROUP, w2s.to(DEVICE), BScale.BLOCK, (G, G)),
             epilogue=GemmEpilogue(topk_weights_Tk=topk_w.to(DEVICE)), launch=FP8_WS_LAUNCH)
    assert len(calls) == 2, "a GEMM ran the Triton kernel"
    inter, inter_s, y = inter.cpu().float(), inter_s.cpu(), y.cpu()
    sid, npp = sorted_ids.cpu(), int(num_pp.cpu())
    a_s = expand_group_scale(xs, K, G)
    for r in range(R):
        e = int(ids.view(-1)[r])
        if e < 0:
            assert y[r].isnan().all(), f"route {r} is not held but was written"
            continue
        p = int((sid[:npp] == r).nonzero()) if sorted_mid else r
        t = r // k
        h = act_and_mul_torch(moe_gemm_torch(xq[t:t + 1], w1q[e], a_s[t:t + 1], _weight_scale(w1s, qc, e, 2 * N, K)),
                              activation)[0]
        want_s = h.view(N // G, G).abs().amax(dim=1) / torch.finfo(FP8_DTYPE).max
        assert torch.allclose(inter_s[p], want_s, rtol=1e-2), f"route {r} (expert {e}): intermediate scales"
        deq = inter[p] * expand_group_scale(inter_s[p], N, G)
        assert _rel(deq, h) <= FP8_EPS, f"route {r} (expert {e}): intermediate"
        ref = moe_gemm_torch(inter[p: p + 1], w2q[e], expand_group_scale(inter_s[p: p + 1], N, G),
                             _weight_scale(w2s, qc, e, K, N)) * topk_w.view(-1)[r]
        assert _rel(y[r: r + 1], ref) <= 2 * torch.finfo(torch.bfloat16).eps, f"route {r} (expert {e}): output"
    if sorted_mid:
        assert inter[sid == R].isnan().all(), "padding rows were written"


@pytest.mark.skipif(not gpu_has_tma(DEVICE), reason="the fp8 warp-specialized Gluon kernel needs a Hopper-class GPU "
                    "(Triton's interpreter does not run Gluon); elsewhere LaunchOptions.ws runs the Triton kernel")
@pytest.mark.parametrize("tile", [FP8_WS_TILE, FP8_WS_WIDE], ids=["128", "wide"])
def test_moe_gemm_ws_fp8_row_chain_matches_oracle(tile, monkeypatch):
    # fp8-token (per-row activation, per-channel weight scales): the first GEMM gathers token rows into a float32
    # h1 (R, 2N); the second reads the intermediate (quantized per row here, as act_and_mul does) and writes routes
    # times the top-k weights in bf16. K = 384, N = 384; 128-column tiles or wide ones (256 columns: h1's 768 in
    # three, y's 384 in two, the second's upper half past K). Both GEMMs run the fp8 kernel (counted).
    from moe_modular.kernels import moe_gemm_ws_fp8

    calls = []
    real = moe_gemm_ws_fp8.moe_gemm_ws_fp8
    monkeypatch.setattr(moe_gemm_ws_fp8, "moe_gemm_ws_fp8", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    K, N = 384, 384
    qc = QuantConfig.fp8_per_token()
    ids, xq, xs, w1q, w1s, w2q, w2s, topk_w = _fp8_chain_inputs(qc, K, N, seed=92)
    T, k = ids.shape
    R = T * k
    sorted_ids, block_expert, num_pp = moe_align(ids.to(DEVICE), FP8_WS_TILE.BLOCK_M, len(FP8_WS_COUNTS), None)
    align = (sorted_ids, block_expert, num_pp, R)
    h1 = torch.full((R, 2 * N), float("nan"), device=DEVICE)
    moe_gemm(xq.to(DEVICE), w1q.to(DEVICE), h1, tile, SortedRows(*align, k),
             scales=GemmScales(xs.to(DEVICE), AScale.ROW, w1s.to(DEVICE), BScale.CHANNEL), launch=FP8_WS_LAUNCH)
    held = ids.view(-1) >= 0
    inter = torch.zeros(R, N).to(FP8_DTYPE)
    inter_s = torch.ones(R, 1)
    h1c = h1.cpu()
    inter[held], inter_s[held] = quantize_activations(act_and_mul_torch(h1c[held], Activation.SILU), qc)
    y = torch.full((R, K), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    moe_gemm(inter.to(DEVICE), w2q.to(DEVICE), y, tile, SortedRows(*align),
             scales=GemmScales(inter_s.to(DEVICE), AScale.ROW, w2s.to(DEVICE), BScale.CHANNEL),
             epilogue=GemmEpilogue(topk_weights_Tk=topk_w.to(DEVICE)), launch=FP8_WS_LAUNCH)
    assert len(calls) == 2, "a GEMM ran the Triton kernel"
    y = y.cpu()
    for r in range(R):
        e = int(ids.view(-1)[r])
        if e < 0:
            assert h1c[r].isnan().all() and y[r].isnan().all(), f"route {r} is not held but was written"
            continue
        t = r // k
        ref1 = moe_gemm_torch(xq[t:t + 1], w1q[e], xs[t:t + 1], w1s[e])
        # float32 output: the wgmma's fp8 accumulation over K is the only rounding (as tl.dot's on Hopper)
        assert _rel(h1c[r: r + 1], ref1) <= 4e-3, f"route {r} (expert {e}): h1"
        ref = moe_gemm_torch(inter[r: r + 1], w2q[e], inter_s[r: r + 1], w2s[e]) * topk_w.view(-1)[r]
        assert _rel(y[r: r + 1], ref) <= 2 * torch.finfo(torch.bfloat16).eps, f"route {r} (expert {e}): output"


@GLUON_CHECKED
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-block"])
def test_warp_specialized_launches_take_the_rows_scales_and_epilogue_they_are_given(fp8, monkeypatch):
    # The Gluon kernels run only on a Hopper GPU; their host side runs here: moe_gemm routes a launch that
    # LaunchOptions.ws covers to the Gluon wrapper, which must bind every kernel parameter (checked against the
    # real kernel's names) from the row layout, scales and epilogue it was given.
    from moe_modular.kernels import moe_gemm as G
    from moe_modular.kernels import moe_gemm_ws, moe_gemm_ws_fp8
    from moe_modular.kernels.act_and_mul import ACT_CODE
    from tests.sm90_compile_check import LaunchRecorder

    monkeypatch.setattr(G, "gpu_has_tma", lambda device: True)
    monkeypatch.setattr(G, "gluon_kernels_enabled", lambda version: True)
    module, name = (moe_gemm_ws_fp8, "_moe_gemm_ws_fp8_kernel") if fp8 else (moe_gemm_ws, "_moe_gemm_ws_kernel")
    fake = LaunchRecorder(getattr(module, name))
    monkeypatch.setattr(module, name, fake)
    g = _gen(97)
    k, El, K, N = 2, 3, 256, 128
    T = 9
    ids = torch.randint(0, El, (T, k), generator=g, dtype=torch.int32).to(DEVICE)
    tile = FP8_WS_TILE if fp8 else GemmTile(64, 64, 64, 4, 4, 3)
    sorted_ids, block_expert, npp = moe_align(ids, tile.BLOCK_M, El)
    S, R = sorted_ids.numel(), T * k
    dt = FP8_DTYPE if fp8 else torch.bfloat16
    x = torch.zeros(T, K, device=DEVICE).to(dt)
    w1 = torch.zeros(El, 2 * N, K, device=DEVICE).to(dt)
    if fp8:
        scales = GemmScales(torch.ones(T, K // 128, device=DEVICE), AScale.GROUP,
                            torch.ones(El, 2 * N // 128, K // 128, device=DEVICE), BScale.BLOCK, (128, 128))
        inter = torch.zeros(S, N, device=DEVICE).to(dt)
        epilogue = GemmEpilogue(Activation.GELU, c_scale=torch.ones(S, N // 128, device=DEVICE), c_group=128)
    else:
        scales, inter = GemmScales(), torch.zeros(S, N, dtype=dt, device=DEVICE)
        epilogue = GemmEpilogue(Activation.GELU)
    rows = SortedRows(sorted_ids, block_expert, npp, R, k, a_sorted=False, c_sorted=True)
    moe_gemm(x, w1, inter, tile, rows, scales=scales, epilogue=epilogue, launch=LaunchOptions(ws=1))
    y = torch.zeros(R, K, dtype=torch.bfloat16, device=DEVICE)
    topk_w = torch.rand(T, k, generator=g).to(DEVICE)
    scales2 = (GemmScales(epilogue.c_scale, AScale.GROUP, torch.ones(El, K // 128, N // 128, device=DEVICE),
                          BScale.BLOCK, (128, 128)) if fp8 else GemmScales())
    moe_gemm(inter, torch.zeros(El, K, N, device=DEVICE).to(dt), y, replace(tile, BLOCK_N=128) if not fp8 else tile,
             SortedRows(sorted_ids, block_expert, npp, R, 1, a_sorted=True), scales=scales2,
             epilogue=GemmEpilogue(topk_weights_Tk=topk_w), launch=LaunchOptions(ws=1))
    assert len(fake.launches) == 2, "a GEMM ran the Triton kernel"
    for launch in fake.launches:  # every kernel parameter given exactly once, nothing else
        assert not launch["twice"] and not launch["unknown"], launch
        assert sorted(launch["bound"]) == sorted(fake.names), sorted(set(fake.names) - set(launch["bound"]))
    first, second = (launch["bound"] for launch in fake.launches)
    assert first["sorted_ids_ptr"] is sorted_ids and first["num_post_padded_ptr"] is npp
    assert (first["num_routes"], first["A_ROW_DIV"], first["A_GATHER"], first["C_SORTED"]) == (R, k, True, True)
    assert (first["FUSE_ACT"], first["ACTIVATION"], first["MUL_WEIGHT"]) == (True, ACT_CODE[Activation.GELU], False)
    assert (second["A_ROW_DIV"], second["A_GATHER"], second["C_SORTED"], second["MUL_WEIGHT"]) == (1, False, False, True)
    assert second["topk_weights_ptr"] is topk_w and (second["stride_wt"], second["stride_wk"]) == topk_w.stride()
    assert (first["N"], second["N"]) == (N, K)
    if fp8:
        assert first["a_scale_ptr"] is scales.a and first["b_scale_ptr"] is scales.b
        assert first["c_scale_ptr"] is epilogue.c_scale and first["OUT_GROUP"] == 128
        assert second["a_scale_ptr"] is epilogue.c_scale and second["OUT_GROUP"] == 0
