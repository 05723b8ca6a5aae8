"""The layer API: FusedMoE with the unquantized and fp8 methods, against the float32 oracle."""
from __future__ import annotations

import math

import pytest
import torch

from moe_modular.config import MoEConfig
from moe_modular.experts.naive_batched_experts import NaiveBatchedExperts
from moe_modular.experts.torch_experts import TorchExperts
from moe_modular.fp8_method import Fp8MoEMethod
from moe_modular.fused_moe_layer import FusedMoE, RoutingConfig
from moe_modular.quant import MoEQuantParams, QuantConfig, quantize_weights
from moe_modular.reference import moe_torch
from moe_modular.registry import prepare_finalize_type
from moe_modular.routing import ScoringFunc, fused_topk, grouped_topk
from moe_modular.unquantized_method import UnquantizedFusedMoEMethod
from moe_modular.workspace import WorkspaceCache
from moe_modular.testing.common import tolerance

LAYER_CASES = [
    # (dtype, scheme, T): the edge each case covers
    (torch.float32, QuantConfig(), 5),  # exact-precision path
    (torch.bfloat16, QuantConfig(), 1),  # one token
    (torch.bfloat16, QuantConfig.fp8_per_token(), 9),  # fp8 weights quantized at load
    (torch.bfloat16, QuantConfig.fp8_block((32, 32)), 4),  # block scales, K = 1.5 blocks
]


def _weights(E, K, N, g):
    return torch.randn(E, 2 * N, K, generator=g) / math.sqrt(K), torch.randn(E, K, N, generator=g) / math.sqrt(N)


def _rel(out, ref):
    assert not torch.isnan(out).any()
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("dtype,quant,T", LAYER_CASES, ids=str)
def test_layer_matches_oracle(dtype, quant, T):
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    E, K, N, topk = 6, 48, 32, 2
    moe = MoEConfig(E, topk, K, N, dtype=dtype, quant=quant)
    layer = FusedMoE(moe)
    assert isinstance(layer.method, Fp8MoEMethod if quant.is_quantized else UnquantizedFusedMoEMethod)
    w13, w2 = _weights(E, K, N, g)
    layer.load_weights(w13.to(dtype), w2.to(dtype))
    x = torch.randn(T, K, generator=g).to(dtype)
    out = layer(x)
    tw, ti = fused_topk(x, layer.gate(x), topk, renormalize=True)
    q13, s13 = quantize_weights(w13.to(dtype), quant)
    q2, s2 = quantize_weights(w2.to(dtype), quant)
    ref = moe_torch(x, q13, q2, tw, ti, quant=MoEQuantParams(quant, s13, s2))
    assert _rel(out, ref) < tolerance(dtype, quant)


def test_layer_grouped_routing_and_shared_experts():
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    E, K, N, topk = 8, 32, 16, 2
    moe = MoEConfig(E, topk, K, N, dtype=torch.float32)
    routing = RoutingConfig(num_expert_group=4, topk_group=2, scoring_func=ScoringFunc.SIGMOID,
                            use_correction_bias=True, routed_scaling_factor=2.5)
    shared = torch.nn.Linear(K, K)
    layer = FusedMoE(moe, routing=routing, shared_experts=shared)
    layer.e_score_correction_bias.data.copy_(torch.randn(E, generator=g))
    w13, w2 = _weights(E, K, N, g)
    layer.load_weights(w13, w2)
    x = torch.randn(7, K, generator=g)
    shared_out, out = layer(x)
    tw, ti = grouped_topk(x, layer.gate(x), topk, True, 4, 2, scoring_func=ScoringFunc.SIGMOID,
                          routed_scaling_factor=2.5, e_score_correction_bias=layer.e_score_correction_bias)
    assert _rel(out, moe_torch(x, w13, w2, tw, ti)) < 1e-5
    assert torch.allclose(shared_out, shared(x))


def test_method_builds_kernel_from_registries():
    moe = MoEConfig(4, 2, 16, 8, dtype=torch.float32)
    layer = FusedMoE(moe)
    layer.load_weights(torch.randn(4, 16, 16), torch.randn(4, 16, 8))
    kernel = layer.method.init_prepare_finalize(layer)
    assert type(kernel.prepare_finalize) is prepare_finalize_type("none")
    assert type(kernel.fused_experts) is TorchExperts or "Triton" in type(kernel.fused_experts).__name__


def test_forced_experts_type_and_shared_workspaces():
    moe = MoEConfig(4, 2, 16, 8, dtype=torch.float32)
    cache = WorkspaceCache()
    layers = [FusedMoE(moe, UnquantizedFusedMoEMethod(moe, experts_type=TorchExperts), workspaces=cache)
              for _ in range(2)]
    x = torch.randn(3, 16)
    for layer in layers:
        layer.load_weights(torch.randn(4, 16, 16), torch.randn(4, 16, 8))
        layer(x)
    allocations = cache.num_allocations
    for layer in layers:
        layer(x)
    assert cache.num_allocations == allocations
    assert all(type(layer.method.kernel.fused_experts) is TorchExperts for layer in layers)


def _loaded(layer: FusedMoE) -> FusedMoE:
    """layer with seeded random expert weights loaded."""
    moe = layer.moe
    g = torch.Generator().manual_seed(0)
    layer.load_weights(torch.randn(moe.num_local_experts, 2 * moe.intermediate_dim, moe.hidden_dim, generator=g),
                       torch.randn(moe.num_local_experts, moe.hidden_dim, moe.intermediate_dim, generator=g))
    return layer


@pytest.mark.parametrize("build,text", [
    (lambda: UnquantizedFusedMoEMethod(MoEConfig(4, 2, 16, 8, quant=QuantConfig.fp8_per_token())),
     "needs moe.quant unquantized, got fp8-token"),
    (lambda: Fp8MoEMethod(MoEConfig(4, 2, 16, 8)), "needs an fp8 moe.quant"),
    (lambda: FusedMoE(MoEConfig(4, 2, 16, 8)).load_weights(torch.zeros(4, 16, 8), torch.zeros(4, 16, 8)),
     "w13 (4, 16, 8) and w2 (4, 16, 8) must be (4, 16, 16) and (4, 16, 8)"),
    (lambda: FusedMoE(MoEConfig(4, 2, 16, 8, quant=QuantConfig.fp8_per_tensor(static=True))).load_weights(
        torch.zeros(4, 16, 16), torch.zeros(4, 16, 8)), "takes scales ['a1_scale', 'a2_scale'], got []"),
    (lambda: RoutingConfig(num_expert_group=4), "must be set together"),
    (lambda: prepare_finalize_type("nccl_typo"), "all2all backend ('nccl_typo') has no PrepareAndFinalize; valid:"),
    (lambda: _loaded(FusedMoE(MoEConfig(4, 2, 16, 8), UnquantizedFusedMoEMethod(
        MoEConfig(4, 2, 16, 8), experts_type=NaiveBatchedExperts)))(torch.zeros(1, 16, dtype=torch.bfloat16)),
     "produces the standard activation format but NaiveBatchedExperts takes batched"),
])
def test_layer_errors(build, text):
    with pytest.raises(ValueError) as info:
        build()
    assert text in str(info.value)
