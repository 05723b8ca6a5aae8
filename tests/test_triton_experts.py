"""TritonExperts and BatchedTritonExperts against the float32 oracle moe_torch, their capability
answers, and the tile tables.

Runs on CUDA when present, else on the CPU through Triton's interpreter (tests/conftest.py).
Outputs and workspaces are pre-filled with NaN, so a row the experts forget to write fails.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import pytest
import torch

from moe_modular.config import Activation, MoEConfig
from moe_modular.experts import batched_triton_experts as batched_triton_experts_module
from moe_modular.experts.batched_triton_experts import BatchedTritonExperts
from moe_modular.experts import triton_experts as triton_experts_module
from moe_modular.experts.triton_experts import TritonExperts
from moe_modular.interfaces import ActivationFormat
from moe_modular.kernels.gemm_config import GemmTile, LaunchOptions
from moe_modular.kernels.moe_gemm import gpu_has_tma
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.prepare_finalize.batched import BatchedPrepareAndFinalize
from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
from moe_modular.quant import MoEQuantParams, QuantConfig, quantize_weights
from moe_modular.reference import moe_torch
from moe_modular.tile_config import (
    CONFIG_DIR,
    TileConfig,
    TileConfigTable,
    TileKey,
    default_tile_config,
    fp8_ws_tile_configs,
)
from moe_modular.weight_and_reduce import TopKWeightAndReduceDelegate, TopKWeightAndReduceNoOp
from moe_modular.workspace import WorkspaceCache
from moe_modular.testing.common import tolerance

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class Case:
    T: int
    E: int
    topk: int
    K: int = 200  # not a multiple of the 128-wide K tiles or of 128-wide fp8 groups
    N: int = 72  # intermediate; 2N = 144 is not a multiple of the column tiles
    dtype: torch.dtype = torch.bfloat16
    quant: QuantConfig = QuantConfig()
    activation: Activation = Activation.SILU
    held: tuple[int, ...] = ()  # global experts held here (an expert_map); () = all
    on_input: bool = False  # apply_router_weight_on_input (topk 1)


STANDARD_CASES = [
    Case(1, 4, 1),  # M=1, topk=1 (one token: one block per route, no alignment)
    Case(1, 8, 3, held=(1, 2, 5, 6)),  # one token with an expert_map: routes to -1 experts write nothing
    Case(1, 6, 2, quant=QuantConfig.fp8_block((64, 32))),  # one token, fp8 block (act_and_mul between)
    Case(0, 4, 2),  # M=0: nothing to compute, nothing written
    Case(9, 7, 3),  # prime E
    Case(5, 3, 3),  # topk == E: every expert gets every token
    Case(6, 7, 2, dtype=torch.float16, activation=Activation.GELU),  # fp16, GELU
    Case(6, 5, 2, dtype=torch.float32),  # fp32 (ieee dot)
    Case(7, 8, 2, activation=Activation.SWIGLU_OAI, held=(1, 2, 5, 6)),  # expert_map: -1 experts write nothing
    Case(4, 5, 1, on_input=True),  # router weight applied to the input
    Case(6, 7, 2, quant=QuantConfig.fp8_per_tensor()),  # fp8 dynamic per-tensor (per-expert intermediate scale)
    Case(6, 7, 2, quant=QuantConfig.fp8_per_tensor(static=True)),  # fp8 static per-tensor
    Case(6, 7, 2, quant=QuantConfig.fp8_per_token()),  # fp8 per-token activations, per-channel weights
    Case(6, 7, 2, quant=QuantConfig.fp8_block((128, 128))),  # fp8 1x128 groups, 128x128 blocks (partial)
    Case(5, 8, 2, quant=QuantConfig.fp8_block((64, 32)), held=(0, 3, 4, 7)),  # small blocks + expert_map
]

BATCHED_CASES = [
    Case(1, 4, 1),  # M=1, topk=1: three experts get no token
    Case(9, 7, 3),  # prime E
    Case(6, 5, 2, dtype=torch.float32, activation=Activation.SWIGLU_OAI),
    Case(4, 5, 1, on_input=True),
    Case(6, 7, 2, quant=QuantConfig.fp8_per_tensor()),
    Case(6, 7, 2, quant=QuantConfig.fp8_per_tensor(static=True)),
    Case(6, 7, 2, quant=QuantConfig.fp8_per_token()),
    Case(6, 7, 2, quant=QuantConfig.fp8_block((128, 128))),
]


def _name(c: Case) -> str:
    return (f"T{c.T}-E{c.E}-k{c.topk}-{str(c.dtype)[6:]}-{c.quant.name}-{c.activation.value}"
            f"{'-map' if c.held else ''}{'-oninput' if c.on_input else ''}")


def make_inputs(c: Case, seed: int = 0):
    """(moe, quant params, x, w1, w2, topk_weights, topk_ids, expert_map) on DEVICE; w1/w2 hold
    only the held experts when an expert map is used."""
    g = torch.Generator().manual_seed(seed)
    moe = MoEConfig(num_experts=c.E, topk=c.topk, hidden_dim=c.K, intermediate_dim=c.N, dtype=c.dtype,
                    quant=c.quant, activation=c.activation, max_num_tokens=max(c.T, 1))
    x = torch.randn(c.T, c.K, generator=g).to(c.dtype)
    w1 = torch.randn(c.E, 2 * c.N, c.K, generator=g) / c.K ** 0.5
    w2 = torch.randn(c.E, c.K, c.N, generator=g) / c.N ** 0.5
    held = list(c.held) if c.held else list(range(c.E))
    w1, w2 = w1[held], w2[held]
    w1q, s1 = quantize_weights(w1, c.quant)
    w2q, s2 = quantize_weights(w2, c.quant)
    if not c.quant.is_quantized:
        w1q, w2q = w1q.to(c.dtype), w2q.to(c.dtype)
    a1s = a2s = None
    if c.quant.static_activation_scale:
        a1s = (x.float().abs().amax().clamp(min=1e-6) / 448).reshape(1)
        a2s = torch.tensor([0.01])
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    qp = MoEQuantParams(c.quant, dev(s1), dev(s2), dev(a1s), dev(a2s))
    logits = torch.randn(c.T, c.E, generator=g)
    tw, ti = torch.topk(logits.softmax(-1), c.topk)
    expert_map = None
    if c.held:
        expert_map = torch.full((c.E,), -1, dtype=torch.int32)
        expert_map[torch.tensor(held)] = torch.arange(len(held), dtype=torch.int32)
        expert_map = expert_map.to(DEVICE)
    return moe, qp, x.to(DEVICE), w1q.to(DEVICE), w2q.to(DEVICE), tw.float().to(DEVICE), ti.to(torch.int32).to(
        DEVICE), expert_map


def _reference(c, qp, x, w1, w2, tw, ti, expert_map):
    return moe_torch(x, w1, w2, tw, ti, c.activation, qp, expert_map=expert_map,
                     apply_router_weight_on_input=c.on_input)


def _poisoned_workspaces(fe, M, N2, K, topk, E, El, meta=None):
    ws13, ws2, out_shape, dtype = fe.workspace_shapes(M, N2, K, topk, E, El, meta)
    nan = lambda s: torch.full(s, float("nan"), dtype=dtype, device=DEVICE)  # noqa: E731
    return nan(ws13), nan(ws2), nan(out_shape)


@pytest.mark.parametrize("c", STANDARD_CASES, ids=_name)
def test_triton_experts_match_oracle(c: Case):
    moe, qp, x, w1, w2, tw, ti, expert_map = make_inputs(c, seed=c.T + 11 * c.E)
    fe = TritonExperts(moe, qp)
    pf = MoEPrepareAndFinalizeNoEP()
    prepared = pf.prepare(x, tw, ti, c.E, expert_map, c.on_input, qp)
    El, N2 = w1.shape[0], w1.shape[1]
    ws13, ws2, out = _poisoned_workspaces(fe, c.T, N2, c.K, c.topk, c.E, El)
    assert tuple(out.shape) == (c.T, c.K)
    fe.apply(out, prepared.a1q, w1, w2, tw, ti, c.activation, c.E, expert_map, prepared.a1q_scale, qp.a2_scale,
             ws13, ws2, None, c.on_input)
    ref = _reference(c, qp, x, w1, w2, tw, ti, expert_map)
    if c.T == 0:
        assert out.numel() == 0
        return
    assert torch.isfinite(out).all(), "a row of the output was not written"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= tolerance(c.dtype, c.quant), f"relative error {err:.3e}"


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "separate"])
@pytest.mark.parametrize("c", [Case(9, 7, 3), Case(6, 7, 2, dtype=torch.float16, activation=Activation.GELU),
                               Case(7, 8, 2, held=(1, 2, 5, 6))], ids=_name)
def test_activation_in_the_first_gemm_or_its_own_kernel(c: Case, fuse: bool, monkeypatch):
    # Unquantized SiLU / GELU: fused, the first GEMM writes act(gate) * up and act_and_mul never
    # runs; fuse_activation=False keeps the separate kernel. Both match the oracle.
    calls = []
    real = triton_experts_module.act_and_mul
    monkeypatch.setattr(triton_experts_module, "act_and_mul", lambda *a, **k: calls.append(1) or real(*a, **k))
    moe, qp, x, w1, w2, tw, ti, expert_map = make_inputs(c, seed=c.T + 3 * c.E)
    fe = TritonExperts(moe, qp, fuse_activation=fuse)
    ws13, ws2, out = _poisoned_workspaces(fe, c.T, w1.shape[1], c.K, c.topk, c.E, w1.shape[0])
    fe.apply(out, x, w1, w2, tw, ti, c.activation, c.E, expert_map, None, None, ws13, ws2, None, False)
    assert len(calls) == (0 if fuse else 1)
    ref = _reference(c, qp, x, w1, w2, tw, ti, expert_map)
    assert torch.isfinite(out).all(), "a row of the output was not written"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= tolerance(c.dtype, c.quant), f"relative error {err:.3e}"


@pytest.mark.parametrize("c", BATCHED_CASES, ids=_name)
def test_batched_triton_experts_match_oracle(c: Case):
    moe, qp, x, w1, w2, tw, ti, _ = make_inputs(c, seed=c.T + 13 * c.E)
    fe = BatchedTritonExperts(moe, qp)
    pf = BatchedPrepareAndFinalize.make(moe)
    prepared = pf.prepare(x, tw, ti, c.E, None, c.on_input, qp)
    El, B = prepared.a1q.shape[:2]
    ws13, ws2, out = _poisoned_workspaces(fe, B, w1.shape[1], c.K, c.topk, c.E, El, prepared.expert_tokens_meta)
    assert tuple(out.shape) == (El, B, c.K)
    fe.apply(out, prepared.a1q, w1, w2, tw, ti, c.activation, c.E, None, prepared.a1q_scale, qp.a2_scale,
             ws13, ws2, prepared.expert_tokens_meta, c.on_input)
    counts = prepared.expert_tokens_meta.expert_num_tokens.cpu()
    for e in range(El):
        n = int(counts[e])
        assert torch.isfinite(out[e, :n]).all(), f"expert {e}: a used slot was not written"
        assert out[e, n:].isnan().all(), f"expert {e}: a slot past its count was written"
    final = torch.empty_like(x)
    pf.finalize(final, out, tw, ti, c.on_input, fe.finalize_weight_and_reduce_impl(), prepared.handle)
    ref = _reference(c, qp, x, w1, w2, tw, ti, None)
    err = ((final.float() - ref).norm() / ref.norm()).item()
    assert err <= tolerance(c.dtype, c.quant), f"relative error {err:.3e}"


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "separate"])
def test_batched_activation_in_the_first_gemm_or_its_own_kernel(fuse: bool, monkeypatch):
    calls = []
    real = batched_triton_experts_module.act_and_mul
    monkeypatch.setattr(batched_triton_experts_module, "act_and_mul", lambda *a, **k: calls.append(1) or real(*a, **k))
    c = Case(9, 7, 3, activation=Activation.GELU)
    moe, qp, x, w1, w2, tw, ti, _ = make_inputs(c, seed=21)
    fe = BatchedTritonExperts(moe, qp, fuse_activation=fuse)
    pf = BatchedPrepareAndFinalize.make(moe)
    prepared = pf.prepare(x, tw, ti, c.E, None, False, qp)
    El, B = prepared.a1q.shape[:2]
    ws13, ws2, out = _poisoned_workspaces(fe, B, w1.shape[1], c.K, c.topk, c.E, El, prepared.expert_tokens_meta)
    fe.apply(out, prepared.a1q, w1, w2, tw, ti, c.activation, c.E, None, None, None, ws13, ws2,
             prepared.expert_tokens_meta, False)
    assert len(calls) == (0 if fuse else 1)
    counts = prepared.expert_tokens_meta.expert_num_tokens.cpu()
    for e in range(El):
        assert out[e, int(counts[e]):].isnan().all(), f"expert {e}: a slot past its count was written"
    final = torch.empty_like(x)
    pf.finalize(final, out, tw, ti, False, fe.finalize_weight_and_reduce_impl(), prepared.handle)
    ref = _reference(c, qp, x, w1, w2, tw, ti, None)
    assert ((final.float() - ref).norm() / ref.norm()).item() <= tolerance(c.dtype, c.quant)


def test_fused_sizing_refuses_an_activation_it_cannot_fuse():
    # The workspaces are sized for MoEConfig.activation: fused SiLU stores no h1, so a call with
    # swiglu-oai (not fusable) must fail naming both, not write past the workspace. h1 (2N = 144
    # columns) is wider than y (K = 64), so it decides the separate kernel's workspace13.
    c = Case(4, 5, 2, K=64)
    moe, qp, x, w1, w2, tw, ti, _ = make_inputs(c, seed=3)
    fe = TritonExperts(moe, qp)
    ws13, ws2, out = _poisoned_workspaces(fe, c.T, w1.shape[1], c.K, c.topk, c.E, w1.shape[0])
    sized_separate = TritonExperts(moe, qp, fuse_activation=False).workspace_shapes(
        c.T, w1.shape[1], c.K, c.topk, c.E, w1.shape[0], None)[0]
    assert ws13.numel() < sized_separate[0], "fused sizing should leave h1 out of workspace13"
    with pytest.raises(ValueError, match=r"activation \(swigluoai\).*MoEConfig.activation \(silu\)"):
        fe.apply(out, x, w1, w2, tw, ti, Activation.SWIGLU_OAI, c.E, None, None, None, ws13, ws2, None, False)


def test_triton_experts_chunked_through_the_modular_kernel():
    # M=11 tokens in chunks of 4 (the last one partial), fp8 per-token so the per-row scales are
    # sliced per chunk; the chunks share the workspaces sized for the first one.
    c = Case(11, 6, 2, quant=QuantConfig.fp8_per_token())
    moe, qp, x, w1, w2, tw, ti, _ = make_inputs(c, seed=5)
    cache = WorkspaceCache()
    mk = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), TritonExperts(moe, qp), workspaces=cache, chunk_size=4)
    out = mk(x, w1, w2, tw, ti)
    ref = _reference(c, qp, x, w1, w2, tw, ti, None)
    assert ((out.float() - ref).norm() / ref.norm()).item() <= tolerance(c.dtype, c.quant)
    allocations = cache.num_allocations
    mk(x, w1, w2, tw, ti)
    assert cache.num_allocations == allocations, "a second forward of the same size allocated workspaces"


@pytest.mark.parametrize("mode", ["output", "inplace", "chunked"])
def test_experts_write_the_callers_output_when_finalize_would_only_copy(mode, monkeypatch):
    # NoEP + TritonExperts (weighted and reduced already): the experts write `output` itself and
    # finalize has nothing to copy; inplace (output is the experts' input) goes through a workspace.
    c = Case(7, 5, 2)
    moe, qp, x, w1, w2, tw, ti, _ = make_inputs(c, seed=12)
    seen = []
    real = MoEPrepareAndFinalizeNoEP.finalize
    monkeypatch.setattr(MoEPrepareAndFinalizeNoEP, "finalize",
                        lambda self, out, fused, *a: seen.append(fused.data_ptr() == out.data_ptr()) or real(
                            self, out, fused, *a))
    ref = _reference(c, qp, x, w1, w2, tw, ti, None)
    mk = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), TritonExperts(moe, qp),
                               workspaces=WorkspaceCache(poison=float("nan")), chunk_size=3 if mode == "chunked" else 64)
    if mode == "inplace":
        out = mk(x.clone(), w1, w2, tw, ti, inplace=True)
    else:
        out = mk(x, w1, w2, tw, ti, output=torch.full_like(x, float("nan")))
    assert seen == [mode != "inplace"]
    assert torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() <= tolerance(c.dtype, c.quant)


def test_fixed_tiles_override_the_tables():
    # A fixed tile config with a K tile larger than the fp8 group is capped to the group at use.
    c = Case(3, 4, 2, quant=QuantConfig.fp8_block((64, 32)))
    moe, qp, x, w1, w2, tw, ti, _ = make_inputs(c, seed=9)
    tile = GemmTile(16, 64, 32, 1, 4, 2)
    fe = TritonExperts(moe, qp, tile_config=TileConfig(tile, replace(tile, BLOCK_N=32)))
    out = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), fe)(x, w1, w2, tw, ti)
    ref = _reference(c, qp, x, w1, w2, tw, ti, None)
    assert ((out.float() - ref).norm() / ref.norm()).item() <= tolerance(c.dtype, c.quant)


SORTED_CASES = [Case(9, 7, 3, held=(0, 2, 3, 5, 6)), Case(6, 7, 2, dtype=torch.float16, activation=Activation.GELU),
                Case(6, 7, 2, quant=QuantConfig.fp8_per_token())]  # fp8: the intermediate stays in route order


@pytest.mark.parametrize("a_tma", [(1, 1), (0, 1), (1, 0)], ids=["both", "gemm2", "gemm1"])
@pytest.mark.parametrize("c", SORTED_CASES, ids=_name)
def test_sorted_rows_through_descriptors_match_oracle(c: Case, a_tma, monkeypatch):
    # launch1.a_tma: the tokens are gathered into sorted order (sort_rows) and GEMM1 reads them by block;
    # launch2.a_tma: GEMM1 writes the intermediate in sorted order for GEMM2. Only where GEMM1 applies
    # the activation (fp8 schemes keep route order); workspaces poisoned, results match the oracle.
    calls = []
    real = triton_experts_module.sort_rows
    monkeypatch.setattr(triton_experts_module, "sort_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    moe, qp, x, w1, w2, tw, ti, expert_map = make_inputs(c, seed=c.T + 5 * c.E)
    tile = GemmTile(16, 64, 64, 1, 4, 2)
    fe = TritonExperts(moe, qp, tile_config=TileConfig(tile, tile, LaunchOptions(1, a_tma[0]), LaunchOptions(1, a_tma[1])))
    El, N2 = w1.shape[0], w1.shape[1]
    route_order = TritonExperts(moe, qp, tile_config=TileConfig(tile, tile, LaunchOptions(1), LaunchOptions(1)))
    sized = [fe.workspace_shapes(c.T, N2, c.K, c.topk, c.E, El, None)[i][0] for i in (0, 1)]
    plain = [route_order.workspace_shapes(c.T, N2, c.K, c.topk, c.E, El, None)[i][0] for i in (0, 1)]
    sorts = (0, 0) if c.quant.is_quantized else a_tma  # sorted rows need room for the per-expert padding
    assert sized[0] > plain[0] if sorts[0] else sized[0] == plain[0]
    assert sized[1] > plain[1] if sorts[1] else sized[1] == plain[1]
    pf = MoEPrepareAndFinalizeNoEP()
    prepared = pf.prepare(x, tw, ti, c.E, expert_map, False, qp)
    ws13, ws2, out = _poisoned_workspaces(fe, c.T, N2, c.K, c.topk, c.E, El)
    fe.apply(out, prepared.a1q, w1, w2, tw, ti, c.activation, c.E, expert_map, prepared.a1q_scale, qp.a2_scale,
             ws13, ws2, None, False)
    assert len(calls) == (a_tma[0] if not c.quant.is_quantized else 0)
    ref = _reference(c, qp, x, w1, w2, tw, ti, expert_map)
    assert torch.isfinite(out).all(), "a row of the output was not written"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= tolerance(c.dtype, c.quant), f"relative error {err:.3e}"


@pytest.mark.skipif(not gpu_has_tma(DEVICE), reason="the warp-specialized Gluon kernel needs a Hopper-class GPU "
                    "(Triton's interpreter does not run Gluon); elsewhere LaunchOptions.ws runs the Triton kernel")
@pytest.mark.parametrize("c,a_tma", [(c, (1, 1)) for c in SORTED_CASES if not c.quant.is_quantized] + [
    (Case(9, 7, 3, K=256, N=64, held=(0, 2, 3, 5, 6)), (0, 1)),
    (Case(6, 7, 2, K=256, N=64, dtype=torch.float16, activation=Activation.GELU), (0, 0))],
    ids=lambda v: _name(v) if isinstance(v, Case) else f"a_tma{v}")
def test_warp_specialized_gemms_match_oracle(c: Case, a_tma, monkeypatch):
    # ws: both GEMMs run the Gluon kernel (counted), on sorted rows (a_tma 1) or rows the kernel
    # gathers (a_tma 0; whole K tiles); workspaces poisoned.
    from moe_modular.kernels import moe_gemm_ws

    calls = []
    real = moe_gemm_ws.moe_gemm_ws
    monkeypatch.setattr(moe_gemm_ws, "moe_gemm_ws", lambda *a, **k: calls.append(1) or real(*a, **k))
    moe, qp, x, w1, w2, tw, ti, expert_map = make_inputs(c, seed=c.T + 3 * c.E)
    tile = GemmTile(64, 64, 64, 4, 4, 3)
    fe = TritonExperts(moe, qp, tile_config=TileConfig(tile, tile, LaunchOptions(1, a_tma[0], ws=1),
                                                       LaunchOptions(1, a_tma[1], ws=1)))
    El, N2 = w1.shape[0], w1.shape[1]
    prepared = MoEPrepareAndFinalizeNoEP().prepare(x, tw, ti, c.E, expert_map, False, qp)
    ws13, ws2, out = _poisoned_workspaces(fe, c.T, N2, c.K, c.topk, c.E, El)
    fe.apply(out, prepared.a1q, w1, w2, tw, ti, c.activation, c.E, expert_map, prepared.a1q_scale, qp.a2_scale,
             ws13, ws2, None, False)
    assert len(calls) == 2
    ref = _reference(c, qp, x, w1, w2, tw, ti, expert_map)
    assert torch.isfinite(out).all(), "a row of the output was not written"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= tolerance(c.dtype, c.quant), f"relative error {err:.3e}"


PDL_CASES = [Case(1, 8, 3, held=(1, 2, 5, 6)),  # one token: per-route blocks, unheld routes
             Case(9, 7, 3), Case(6, 7, 2, dtype=torch.float16, activation=Activation.GELU),
             Case(7, 8, 2, quant=QuantConfig.fp8_per_token())]  # the second GEMM with activation scales


@pytest.mark.skipif(not gpu_has_tma(DEVICE), reason="programmatic dependent launch (griddepcontrol) needs a GPU of "
                    "compute capability >= 9; elsewhere pdl launches as usual")
@pytest.mark.parametrize("persistent", [0, 2], ids=["tiles", "persistent"])
@pytest.mark.parametrize("c", PDL_CASES, ids=_name)
def test_programmatic_dependent_launches_match_oracle(c: Case, persistent: int):
    # pdl: both GEMMs and (the second GEMM's pdl) the top-k sum are placed while the kernel before each is still running
    # and wait for its end; eager and replayed from a CUDA graph with fresh inputs copied in, workspaces
    # poisoned before each, both match the oracle.
    moe, qp, x, w1, w2, tw, ti, expert_map = make_inputs(c, seed=c.T + 13 * c.E)
    tile = GemmTile(16, 64, 64, 1, 4, 2)
    fe = TritonExperts(moe, qp, tile_config=TileConfig(tile, tile, LaunchOptions(pdl=1),
                                                       LaunchOptions(pdl=1, persistent=persistent)))
    _check_eager_then_graph(c, fe, qp, (x, w1, w2, tw, ti, expert_map), c.T + 13 * c.E + 1)


def _check_eager_then_graph(c: Case, fe, qp, inputs, replay_seed: Optional[int]) -> None:
    """fe's apply (NoEP prepare first) against the oracle eagerly, then (unless replay_seed is None) replayed from a
    CUDA graph on fresh inputs (make_inputs(c, replay_seed)) copied in, with the workspaces and the output poisoned
    before each."""
    x, w1, w2, tw, ti, expert_map = inputs
    El, N2 = w1.shape[0], w1.shape[1]
    pf = MoEPrepareAndFinalizeNoEP()
    ws13, ws2, out = _poisoned_workspaces(fe, c.T, N2, c.K, c.topk, c.E, El)

    def forward():
        prepared = pf.prepare(x, tw, ti, c.E, expert_map, False, qp)
        fe.apply(out, prepared.a1q, w1, w2, tw, ti, c.activation, c.E, expert_map, prepared.a1q_scale,
                 qp.a2_scale, ws13, ws2, None, False)

    def check():
        ref = _reference(c, qp, x, w1, w2, tw, ti, expert_map)
        assert torch.isfinite(out).all(), "a row of the output was not written"
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err <= tolerance(c.dtype, c.quant), f"relative error {err:.3e}"

    forward()
    check()
    if replay_seed is None:
        return
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    _, _, x2, _, _, tw2, ti2, _ = make_inputs(c, seed=replay_seed)
    for dst, src in ((x, x2), (tw, tw2), (ti, ti2)):
        dst.copy_(src)
    for t in (ws13, ws2, out):
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check()


ACT_Q_CASES = [Case(9, 7, 2, quant=QuantConfig.fp8_block((64, 32))),
               Case(7, 8, 2, quant=QuantConfig.fp8_block((64, 32)), held=(0, 3, 4, 7), activation=Activation.GELU),
               Case(1, 6, 3, quant=QuantConfig.fp8_block((64, 32)))]  # one token: per-route blocks


@pytest.mark.parametrize("c", ACT_Q_CASES, ids=_name)
def test_fp8_block_activation_and_quantization_in_the_first_gemm_match_oracle(c: Case, monkeypatch):
    # act_q: the fp8-block first GEMM applies the activation and quantizes the intermediate in 1 x 32
    # groups in its epilogue (fused BLOCK_N 32 holds one group): no float32 h1 in workspace13, no
    # act_and_mul launch; workspaces poisoned, results match the oracle
    calls = []
    real = triton_experts_module.act_and_mul
    monkeypatch.setattr(triton_experts_module, "act_and_mul", lambda *a, **k: calls.append(1) or real(*a, **k))
    moe, qp, x, w1, w2, tw, ti, expert_map = make_inputs(c, seed=c.T + 7 * c.E)
    tile = GemmTile(16, 64, 32, 1, 4, 2)
    fe = TritonExperts(moe, qp, tile_config=TileConfig(tile, tile, act_q=1))
    plain = TritonExperts(moe, qp, tile_config=TileConfig(tile, tile))
    El, N2 = w1.shape[0], w1.shape[1]
    assert (fe.workspace_shapes(c.T, N2, c.K, c.topk, c.E, El, None)[0][0] <
            plain.workspace_shapes(c.T, N2, c.K, c.topk, c.E, El, None)[0][0]), "h1 still sized"
    prepared = MoEPrepareAndFinalizeNoEP().prepare(x, tw, ti, c.E, expert_map, False, qp)
    ws13, ws2, out = _poisoned_workspaces(fe, c.T, N2, c.K, c.topk, c.E, El)
    fe.apply(out, prepared.a1q, w1, w2, tw, ti, c.activation, c.E, expert_map, prepared.a1q_scale, qp.a2_scale,
             ws13, ws2, None, False)
    assert not calls, "act_and_mul ran"
    ref = _reference(c, qp, x, w1, w2, tw, ti, expert_map)
    assert torch.isfinite(out).all(), "a row of the output was not written"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= tolerance(c.dtype, c.quant), f"relative error {err:.3e}"


def test_act_q_errors_name_the_scheme_and_the_tile():
    c = Case(6, 7, 2, quant=QuantConfig.fp8_per_token())
    moe, qp, x, w1, w2, tw, ti, _ = make_inputs(c, seed=3)
    tile = GemmTile(16, 64, 32, 1, 4, 2)
    with pytest.raises(ValueError, match=r"tile act_q \(1\) is for the fp8 block scheme; the scheme is fp8-token"):
        TritonExperts(moe, qp, tile_config=TileConfig(tile, tile, act_q=1)).workspace_shapes(c.T, w1.shape[1], c.K, c.topk,
                                                                                    c.E, w1.shape[0], None)
    c = Case(6, 7, 2, quant=QuantConfig.fp8_block((64, 64)))
    moe, qp, x, w1, w2, tw, ti, _ = make_inputs(c, seed=3)
    fe = TritonExperts(moe, qp, tile_config=TileConfig(tile, tile, act_q=1))  # fused BLOCK_N 32 < 64
    with pytest.raises(ValueError, match=r"GemmEpilogue.c_group \(64\) must be a power of two dividing tile.BLOCK_N \(32\)"):
        FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), fe)(x, w1, w2, tw, ti)


def test_workspaces_sized_for_route_order_keep_route_order():
    # Workspaces sized for other tiles (route order) are too small for sorted rows: apply keeps route
    # order rather than writing past them, and the result still matches the oracle.
    c = Case(9, 7, 3)
    moe, qp, x, w1, w2, tw, ti, _ = make_inputs(c, seed=4)
    tile = GemmTile(16, 64, 64, 1, 4, 2)
    fe = TritonExperts(moe, qp, tile_config=TileConfig(tile, tile, LaunchOptions(1, 1), LaunchOptions(1, 1)))
    ws13, ws2, out = _poisoned_workspaces(TritonExperts(moe, qp, tile_config=TileConfig(tile, tile)), c.T,
                                          w1.shape[1], c.K, c.topk, c.E, w1.shape[0])
    fe.apply(out, x, w1, w2, tw, ti, c.activation, c.E, None, None, None, ws13, ws2, None, False)
    ref = _reference(c, qp, x, w1, w2, tw, ti, None)
    assert torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() <= tolerance(c.dtype, c.quant)


def test_one_instance_serves_new_workspaces_and_activations():
    # apply keeps its host-side choices per problem and its views per workspace: workspaces freed and
    # drawn again (poisoned), and another activation on the same instance, each still match the oracle.
    c = Case(5, 7, 3)
    moe, qp, x, w1, w2, tw, ti, _ = make_inputs(c, seed=5)
    tile = GemmTile(16, 64, 64, 1, 4, 2)
    fe = TritonExperts(moe, qp, tile_config=TileConfig(tile, tile, LaunchOptions(1), LaunchOptions(1)))
    for activation in (c.activation, Activation.GELU, c.activation):
        for _ in range(2):
            ws13, ws2, out = _poisoned_workspaces(fe, c.T, w1.shape[1], c.K, c.topk, c.E, w1.shape[0])
            fe.apply(out, x, w1, w2, tw, ti, activation, c.E, None, None, None, ws13, ws2, None, False)
            ref = _reference(replace(c, activation=activation), qp, x, w1, w2, tw, ti, None)
            assert torch.isfinite(out).all(), f"{activation}: a row of the output was not written"
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err <= tolerance(c.dtype, c.quant), f"{activation}: relative error {err:.3e}"
            del ws13, ws2


# ---- capabilities -----------------------------------------------------------------------------
def test_capabilities_are_declared_by_the_classes():
    assert TritonExperts.activation_formats() == (ActivationFormat.Standard, ActivationFormat.Standard)
    assert BatchedTritonExperts.activation_formats() == (ActivationFormat.BatchedExperts,
                                                         ActivationFormat.BatchedExperts)
    moe = MoEConfig(num_experts=4, topk=2, hidden_dim=64, intermediate_dim=32)
    std, bat = TritonExperts(moe, MoEQuantParams()), BatchedTritonExperts(moe, MoEQuantParams())
    assert std.supports_chunking() and not bat.supports_chunking()
    assert std.supports_expert_map() and bat.supports_expert_map()
    assert isinstance(std.finalize_weight_and_reduce_impl(), TopKWeightAndReduceNoOp)
    assert isinstance(bat.finalize_weight_and_reduce_impl(), TopKWeightAndReduceDelegate)


@pytest.mark.parametrize("cls", [TritonExperts, BatchedTritonExperts])
def test_supports_names_the_block_shape_it_cannot_serve(cls):
    # K tiles may not straddle an fp8 group, so group sizes must be powers of two >= 16.
    bad = MoEConfig(num_experts=4, topk=2, hidden_dim=192, intermediate_dim=96, quant=QuantConfig.fp8_block((128, 96)))
    ok, reason = cls.supports(bad)
    assert not ok and "block_shape[1] (96)" in reason
    good = replace(bad, quant=QuantConfig.fp8_block((128, 128)))
    assert cls.supports(good) == (True, "") or "compute capability" in cls.supports(good)[1]
    with pytest.raises(ValueError, match="block_shape"):
        cls(bad, MoEQuantParams(bad.quant, torch.ones(4), torch.ones(4)))


# ---- tile tables --------------------------------------------------------------------------------
def test_tile_table_round_trip_and_nearest_bucket(tmp_path):
    key = TileKey(8, 96, 192, "bfloat16", "unquantized", "cpu")
    small, big = GemmTile(16, 64, 128, 1, 4, 2), GemmTile(64, 128, 64, 8, 4, 3)
    # 256: the second GEMM narrower, its weights through pointers while the first uses TMA, and its
    # activations through a descriptor
    buckets = {1: TileConfig(small, small),
               256: TileConfig(big, replace(big, BLOCK_N=64), LaunchOptions(b_tma=1, persistent=2),
                               LaunchOptions(a_tma=1))}
    (tmp_path / TileConfigTable.file_name(key)).write_text(TileConfigTable.to_yaml(key, buckets, "a test table"))
    table = TileConfigTable.load(str(tmp_path))
    assert table.tables == {key: buckets}
    assert table.lookup(key, 8) == buckets[1]  # log2 distance 3 < 5
    assert table.lookup(key, 100) == buckets[256]
    assert table.lookup(replace(key, device="other"), 8) is None
    chosen = table.select(8, 8, 96, 192, 2, torch.bfloat16, QuantConfig(), "other")
    assert chosen == default_tile_config(8, 8, 96, 192, 2, torch.bfloat16, QuantConfig(), "other")


@pytest.mark.parametrize("doc,message", [
    ({"E": 8, "N": 1, "K": 1, "dtype": "bfloat16", "quant": "unquantized", "device": "cpu"}, "keys"),
    ({"E": 8, "N": 1, "K": 1, "dtype": "bfloat16", "quant": "unquantized", "device": "cpu",
      "tiles": {1: {"BLOCK_M": 24, "BLOCK_N": 64, "BLOCK_K": 64}}}, r"gemm1.BLOCK_M \(24\) must be a power of two"),
    ({"E": 8, "N": 1, "K": 1, "dtype": "bfloat16", "quant": "unquantized", "device": "cpu",
      "tiles": {1: {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "gemm2": {"BLOCK_M": 32}}}}, "may not override"),
    ({"E": 8, "N": 1, "K": 1, "dtype": "bfloat16", "quant": "unquantized", "device": "cpu",
      "tiles": {1: {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "warps": 4}}}, r"unknown fields \['warps'\]"),
    ({"E": 8, "N": 1, "K": 1, "dtype": "bfloat16", "quant": "unquantized", "device": "cpu",
      "tiles": {1: {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "gemm2": {"b_tma": 2}}}},
     r"LaunchOptions.b_tma \(2\) must be 0 or 1"),
    ({"E": 8, "N": 1, "K": 1, "dtype": "bfloat16", "quant": "unquantized", "device": "cpu",
      "tiles": {1: {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "a_tma": -1}}},
     r"LaunchOptions.a_tma \(-1\) must be 0 or 1"),
    ({"E": 8, "N": 1, "K": 1, "dtype": "bfloat16", "quant": "unquantized", "device": "cpu",
      "tiles": {1: {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "gemm2": {"persistent": 3}}}},
     r"LaunchOptions.persistent \(3\) must be one of \(0, 1, 2\)"),
    ({"E": 8, "N": 1, "K": 1, "dtype": "bfloat16", "quant": "unquantized", "device": "cpu",
      "tiles": {1: {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "gemm2": {"pdl": 2}}}},
     r"LaunchOptions.pdl \(2\) must be 0 or 1"),
    ({"E": 8, "N": 1, "K": 1, "dtype": "bfloat16", "quant": "fp8-block128x128", "device": "cpu",
      "tiles": {1: {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "gemm2": {"act_q": 1}}}}, "may not override act_q"),
])
def test_tile_table_errors_name_the_field(doc, message):
    with pytest.raises(ValueError, match=message):
        TileConfigTable.parse(doc, "t.yaml")


def test_default_tiles_keep_k_tiles_inside_fp8_groups():
    for M in (1, 64, 4096):
        cfg = default_tile_config(M, 8, 512, 1024, 2, torch.bfloat16, QuantConfig.fp8_block((128, 32)), "NVIDIA_H200")
        assert cfg.gemm1.BLOCK_K <= 32 and cfg.gemm2.BLOCK_K <= 32
    small, large = (default_tile_config(m, 8, 512, 1024, 2, torch.bfloat16, QuantConfig(), "NVIDIA_H200")
                    for m in (1, 4096))
    assert small.block_m < large.block_m


def test_packaged_tables_cover_the_benchmark_shapes():
    table = TileConfigTable.load(CONFIG_DIR)
    for E, N, K in ((8, 14336, 4096), (128, 768, 2048), (256, 2048, 7168)):
        key = TileKey(E, N, K, "bfloat16", "unquantized", "NVIDIA_H200")
        assert key in table.tables
        assert {1, 16384} <= set(table.tables[key])


FP8_WS_CASES = [Case(300, 8, 2, K=384, N=256, quant=QuantConfig.fp8_block((128, 128))),
                Case(260, 6, 3, K=256, N=128, quant=QuantConfig.fp8_block((128, 128)), held=(0, 2, 3, 5),
                     activation=Activation.GELU),  # expert_map: routes to unheld experts write nothing
                Case(300, 8, 2, K=256, N=384, quant=QuantConfig.fp8_per_token())]


# (case, tiles): every configuration of the fp8 warp-specialized kernel the tables and the tuner use for the case's
# scheme (tile_config.fp8_ws_tile_configs: 128-column tiles, and wide ones of two column halves)
FP8_WS_TILINGS = [(c, cfg) for c in FP8_WS_CASES for cfg in fp8_ws_tile_configs(c.quant)]


def _fp8_ws_name(p) -> str:
    c, cfg = p
    return f"{_name(c)}-gemm1N{cfg.gemm1.BLOCK_N}-gemm2N{cfg.gemm2.BLOCK_N}"


def _fp8_ws_wide(cfg: TileConfig) -> list[bool]:
    """Whether each GEMM's launch is a wide tile (BLOCK_N 256 without the activation; the fused first GEMM's 256
    are its gate and up halves)."""
    return [cfg.gemm1.BLOCK_N == 256 and not cfg.act_q, cfg.gemm2.BLOCK_N == 256]


@pytest.mark.skipif(not gpu_has_tma(DEVICE), reason="the fp8 warp-specialized Gluon kernel needs a Hopper-class GPU "
                    "(Triton's interpreter does not run Gluon); elsewhere LaunchOptions.ws runs the Triton kernel")
@pytest.mark.parametrize("p", FP8_WS_TILINGS, ids=_fp8_ws_name)
def test_fp8_warp_specialized_gemms_match_oracle(p, monkeypatch):
    # The tables' fp8 warp-specialized tiles (128 x 128 x 128, two consumer warpgroups; fp8-block also act_q), and
    # the wide tiles a table may select: both GEMMs run the fp8 Gluon kernel (counted, with the wide flag their
    # tile asks); eager and replayed from a CUDA graph with fresh inputs, workspaces poisoned before each, both
    # match the oracle.
    from moe_modular.kernels import moe_gemm_ws_fp8

    c, cfg = p
    calls = []
    real = moe_gemm_ws_fp8.moe_gemm_ws_fp8
    monkeypatch.setattr(moe_gemm_ws_fp8, "moe_gemm_ws_fp8",
                        lambda *a, **k: calls.append(k.get("wide", False)) or real(*a, **k))
    moe, qp, x, w1, w2, tw, ti, expert_map = make_inputs(c, seed=c.T + 5 * c.E)
    fe = TritonExperts(moe, qp, tile_config=cfg)
    _check_eager_then_graph(c, fe, qp, (x, w1, w2, tw, ti, expert_map), c.T + 5 * c.E + 1)
    assert calls == _fp8_ws_wide(cfg) * 2, "a GEMM ran the Triton kernel, or another tile (two GEMMs eagerly, two in " \
        "the capture)"


@pytest.mark.parametrize("p", FP8_WS_TILINGS, ids=_fp8_ws_name)
def test_fp8_warp_specialized_tiles_reach_the_fp8_kernel(p, monkeypatch):
    # On the host, with a Hopper-class GPU stood in: the fp8 warp-specialized tiles send both GEMMs of the forward
    # to moe_gemm_ws_fp8, with the scale layout of the scheme and the wide flag their tile asks. Each launch is
    # stood in by the Triton kernel with the same tile (the GPU test above runs the real one), so the forward
    # must still match the oracle: the arguments the planning passes are complete.
    from moe_modular.kernels import moe_gemm as G
    from moe_modular.kernels import moe_gemm_ws_fp8
    from moe_modular.kernels.common import FP8_WS_TILE, FP8_WS_WARPS

    c, cfg = p
    hopper = {"on": True}
    monkeypatch.setattr(G, "gpu_has_tma", lambda device: hopper["on"])
    monkeypatch.setattr(G, "gluon_kernels_enabled", lambda version: True)
    calls = []

    def stand_in(a, b_ENK, c_out, kind, scales, rows, epilogue, *, tiles, sms, group_m=8, wide=False):
        calls.append((kind.name, epilogue.activation is not None, wide))
        bm, bn, bk = FP8_WS_TILE
        tile = GemmTile(bm, 2 * bn if wide else bn, bk, group_m, FP8_WS_WARPS, 3)
        hopper["on"] = False  # the Triton kernel as on a GPU without TMA (the interpreter)
        try:
            return G.moe_gemm(a, b_ENK, c_out, tile, rows, scales=scales, epilogue=epilogue)
        finally:
            hopper["on"] = True

    monkeypatch.setattr(moe_gemm_ws_fp8, "moe_gemm_ws_fp8", stand_in)
    moe, qp, x, w1, w2, tw, ti, expert_map = make_inputs(c, seed=c.T + 7 * c.E)
    fe = TritonExperts(moe, qp, tile_config=cfg)
    _check_eager_then_graph(c, fe, qp, (x, w1, w2, tw, ti, expert_map), replay_seed=None)
    kind = "BLOCK" if c.quant.is_block else "ROW"
    wide1, wide2 = _fp8_ws_wide(cfg)
    assert calls == [(kind, c.quant.is_block, wide1), (kind, False, wide2)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
@pytest.mark.parametrize("c", [Case(9, 7, 3), Case(6, 8, 2, quant=QuantConfig.fp8_block((128, 128)), held=(0, 3, 4, 7))],
                         ids=_name)
def test_the_default_forward_captures_in_a_cuda_graph(c: Case):
    # The serving forward (FusedMoEModularKernel with its defaults: the free input checks only) makes no
    # device-to-host sync: it captures in a CUDA graph, and a replay on fresh inputs matches the oracle.
    moe, qp, x, w1, w2, tw, ti, expert_map = make_inputs(c, seed=c.T + 17 * c.E)
    mk = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), TritonExperts(moe, qp))
    out = torch.full_like(x, float("nan"))
    kwargs = dict(global_num_experts=c.E, expert_map=expert_map, output=out)
    mk(x, w1, w2, tw, ti, **kwargs)  # compile and plan outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mk(x, w1, w2, tw, ti, **kwargs)
    _, _, x2, _, _, tw2, ti2, _ = make_inputs(c, seed=c.T + 17 * c.E + 1)
    for dst, src in ((x, x2), (tw, tw2), (ti, ti2)):
        dst.copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = _reference(c, qp, x, w1, w2, tw, ti, expert_map)
    assert torch.isfinite(out).all(), "a row of the output was not written"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err <= tolerance(c.dtype, c.quant), f"relative error {err:.3e}"


@pytest.mark.parametrize("quant,ws_gemm1", [
    (QuantConfig(), {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4,
                     "a_tma": 1, "ws": 1}),
    (QuantConfig.fp8_per_token(), {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8,
                                   "num_stages": 3, "ws": 1}),
    (QuantConfig.fp8_block((128, 128)), {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8,
                                         "num_stages": 3, "act_q": 1, "ws": 1}),
])
def test_default_tiles_take_the_warp_specialized_kernel_on_hopper_when_compute_bound(quant, ws_gemm1):
    # Untuned shapes (Qwen3-235B, DeepSeek-V3 at EP8) get the tuned tables' compute-bound choice on Hopper
    # from 97 rows per expert; below that, and on other GPUs, the tl.dot tiles stay.
    E, N, K, topk = 32, 2048, 7168, 8
    for dev in ("NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"):
        big = default_tile_config(4096, E, N, K, topk, torch.bfloat16, quant, dev)
        assert {k: v for k, v in big.to_dict().items() if k != "gemm2"} == ws_gemm1
        assert big.launch2.ws == 1 and big.gemm2.BLOCK_M == 128
        assert not default_tile_config(256, E, N, K, topk, torch.bfloat16, quant, dev).launch1.ws
    for dev in ("NVIDIA_A100-SXM4-80GB", "cpu"):
        assert not default_tile_config(4096, E, N, K, topk, torch.bfloat16, quant, dev).launch1.ws
    # schemes the Hopper tiles were not chosen for keep the generic ones
    for other in (QuantConfig.fp8_per_tensor(), QuantConfig.fp8_block((128, 32))):
        assert not default_tile_config(4096, E, N, K, topk, torch.bfloat16, other, "NVIDIA_H200").launch1.ws


def test_fp8_warp_specialized_configurations_are_the_kernels_tile():
    # tile_config restates the fp8 kernel's tile (it imports no Triton): the two must agree, the tables' choice
    # (the Hopper default) comes first, and every configuration runs both GEMMs in the kernel with 128-row tiles.
    from moe_modular.kernels.common import FP8_WS_GROUP, FP8_WS_TILE, FP8_WS_WARPS
    from moe_modular.tile_config import FP8_WS_HALF, FP8_WS_WIDE, hopper_compute_tile

    assert (FP8_WS_HALF.BLOCK_M, FP8_WS_HALF.BLOCK_N, FP8_WS_HALF.BLOCK_K, FP8_WS_HALF.num_warps) == (
        *FP8_WS_TILE, FP8_WS_WARPS)
    assert FP8_WS_WIDE.BLOCK_N == 2 * FP8_WS_TILE[1] and FP8_WS_HALF.BLOCK_N == FP8_WS_GROUP
    block, token = QuantConfig.fp8_block((128, 128)), QuantConfig.fp8_per_token()
    for quant, n1, n2 in ((block, [256, 256], [128, 256]), (token, [128, 128, 256], [128, 256, 256])):
        configs = fp8_ws_tile_configs(quant)
        assert [c.gemm1.BLOCK_N for c in configs] == n1 and [c.gemm2.BLOCK_N for c in configs] == n2
        assert all((c.launch1.ws, c.launch2.ws, c.gemm1.BLOCK_M, c.gemm2.BLOCK_M, c.act_q) ==
                   (1, 1, 128, 128, int(quant.is_block)) for c in configs)
        for dev in ("NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"):
            assert hopper_compute_tile(torch.bfloat16, quant, dev) == configs[0]
    for other in (QuantConfig(), QuantConfig.fp8_per_tensor(), QuantConfig.fp8_block((128, 64))):
        assert fp8_ws_tile_configs(other) == ()
