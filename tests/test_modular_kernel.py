"""FusedMoEModularKernel and its parts: weight-and-reduce variants, workspace reuse, chunking,
shared experts, apply_router_weight_on_input, M = 0, expert maps, and the error messages."""
from __future__ import annotations

import math

import pytest
import torch

from moe_modular.config import Activation, MoEConfig, ParallelConfig
from moe_modular.experts.naive_batched_experts import NaiveBatchedExperts
from moe_modular.experts.torch_experts import TorchExperts
from moe_modular.interfaces import PrepareResult
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.prepare_finalize.batched import BatchedPrepareAndFinalize
from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
from moe_modular.quant import MoEQuantParams, QuantConfig, quantize_weights
from moe_modular.reference import moe_torch
from moe_modular.weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNaiveBatched,
    TopKWeightAndReduceNoOp,
)
from moe_modular.workspace import WorkspaceCache

BF16_TOL = 2 * torch.finfo(torch.bfloat16).eps
F32_TOL = 1e-5


def _rel(out, ref):
    assert not torch.isnan(out).any(), "unwritten (NaN) output"
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def _problem(T, E, K, N, topk, dtype=torch.float32, quant=QuantConfig(), seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.randint(0, 2**31, ()).item())
    x = torch.randn(T, K, generator=g).to(dtype)
    w1 = (torch.randn(E, 2 * N, K, generator=g) / math.sqrt(K)).to(dtype)
    w2 = (torch.randn(E, K, N, generator=g) / math.sqrt(N)).to(dtype)
    probs = torch.softmax(torch.randn(T, E, generator=g), -1)
    tw, ti = probs.topk(topk, dim=-1)
    w1q, s1 = quantize_weights(w1, quant)
    w2q, s2 = quantize_weights(w2, quant)
    return x, w1q, w2q, tw, ti.to(torch.int32), MoEQuantParams(quant, s1, s2)


def _kernel(moe, qp, batched=False, **kw):
    pf = BatchedPrepareAndFinalize.make(moe) if batched else MoEPrepareAndFinalizeNoEP.make(moe)
    fe = (NaiveBatchedExperts if batched else TorchExperts).for_prepare_finalize(moe, qp, pf)
    return FusedMoEModularKernel(pf, fe, **{"check_inputs": True, **kw})


# ---- TopKWeightAndReduce ------------------------------------------------------------------

def test_contiguous_reduce_matches_loop():
    T, k, K = 5, 3, 8
    y = torch.randn(T, k, K)
    w = torch.rand(T, k)
    out = torch.full((T, K), float("nan"))
    TopKWeightAndReduceContiguous().apply(out, y, w, torch.zeros(T, k, dtype=torch.int32), False)
    ref = sum(y[:, j] * w[:, j:j + 1] for j in range(k))
    assert torch.allclose(out, ref, atol=1e-6)
    # With the weight already applied on the input, the routes are only summed.
    TopKWeightAndReduceContiguous().apply(out, y[:, :1], w[:, :1], torch.zeros(T, 1, dtype=torch.int32), True)
    assert torch.equal(out, y[:, 0])


def test_noop_reduce_copies_or_aliases():
    y = torch.randn(4, 6)
    out = torch.full_like(y, float("nan"))
    assert TopKWeightAndReduceNoOp().apply(out, y, None, None, False) is out
    assert torch.equal(out, y)
    assert TopKWeightAndReduceNoOp().apply(None, y, None, None, False) is y


def test_naive_batched_reduce_follows_slot_order():
    # 3 tokens, topk 2, 2 local experts; local id -1 is held elsewhere and contributes nothing.
    ids = torch.tensor([[0, 1], [1, -1], [0, 1]])
    w = torch.tensor([[0.5, 0.25], [2.0, 9.0], [1.0, 3.0]])
    y = torch.randn(2, 4, 5)  # (El, B, K)
    out = torch.full((3, 5), float("nan"))
    TopKWeightAndReduceNaiveBatched().apply(out, y, w, ids, False)
    # Expert 0 slots: token 0, token 2. Expert 1 slots: token 0, token 1, token 2.
    ref = torch.stack([0.5 * y[0, 0] + 0.25 * y[1, 0], 2.0 * y[1, 1], 1.0 * y[0, 1] + 3.0 * y[1, 2]])
    assert torch.allclose(out, ref, atol=1e-6)


def test_delegate_cannot_run_itself():
    with pytest.raises(RuntimeError, match="is a marker"):
        TopKWeightAndReduceDelegate().apply(None, torch.zeros(1, 1), None, None, False)


# ---- workspaces --------------------------------------------------------------------------

def test_workspaces_are_reused_across_calls_and_layers():
    moe = MoEConfig(8, 2, 32, 16, dtype=torch.float32)
    x, w1, w2, tw, ti, qp = _problem(16, 8, 32, 16, 2)
    cache = WorkspaceCache()
    layer1, layer2 = _kernel(moe, qp, workspaces=cache), _kernel(moe, qp, workspaces=cache)
    layer1(x, w1, w2, tw, ti)
    allocated = cache.num_allocations
    assert allocated > 0
    layer1(x, w1, w2, tw, ti)
    layer2(x, w1, w2, tw, ti)  # a second layer of the same size shares the buffers
    layer1(x[:3], w1, w2, tw[:3], ti[:3])  # smaller: a view, no allocation
    assert cache.num_allocations == allocated
    layer1(torch.cat([x, x]), w1, w2, torch.cat([tw, tw]), torch.cat([ti, ti]))  # larger: grows
    assert cache.num_allocations > allocated


def test_workspace_grows_and_poisons():
    cache = WorkspaceCache(poison=float("nan"))
    a = cache.get("ws", (2, 3), torch.float32, torch.device("cpu"))
    assert torch.isnan(a).all()
    b = cache.get("ws", (1, 2), torch.float32, torch.device("cpu"))
    assert cache.num_allocations == 1 and b.data_ptr() == a.data_ptr()
    cache.get("ws", (4, 4), torch.float32, torch.device("cpu"))
    cache.get("ws", (4, 4), torch.float64, torch.device("cpu"))  # another dtype: its own buffer
    assert cache.num_allocations == 3


def test_workspace_views_are_memoized_per_buffer():
    """A repeated request returns the same view object; after the buffer grows, views over the new buffer
    (none still points into the freed one)."""
    cpu = torch.device("cpu")
    cache = WorkspaceCache()
    a = cache.get("ws", (2, 3), torch.float32, cpu)
    assert cache.get("ws", (2, 3), torch.float32, cpu) is a
    small = cache.get("ws", (1, 2), torch.float32, cpu)
    big = cache.get("ws", (8, 8), torch.float32, cpu)  # grows: a new buffer
    again = cache.get("ws", (1, 2), torch.float32, cpu)
    assert again is not small and again.data_ptr() == big.data_ptr()
    assert cache.get("ws", (2, 3), torch.float32, cpu).data_ptr() == big.data_ptr()
    cache.clear()
    assert cache.get("ws", (2, 3), torch.float32, cpu) is not a and cache.num_allocations == 3


def test_carve_is_memoized_per_workspace():
    """WorkspaceLayout.carve: the same views for the same memory; another workspace gets its own."""
    from moe_modular.experts.triton_plan import WorkspaceLayout

    layout = WorkspaceLayout().add("a", (4, 3), torch.float32).add("b", (5,), torch.int32)
    ws = torch.empty(layout.numel(torch.float32))
    first = layout.carve(ws)
    assert layout.carve(ws) is first and layout.carve(ws.view(-1)) is first
    other = torch.empty_like(ws)
    carved = layout.carve(other)
    assert carved is not first and carved["a"].data_ptr() == other.data_ptr()
    assert first["b"].shape == (5,) and first["b"].dtype == torch.int32


# ---- chunking ----------------------------------------------------------------------------

@pytest.mark.parametrize("T,chunk", [
    (10, 3),  # chunks of 3, 3, 3, 1: a ragged last chunk
    (8, 8),  # exactly one chunk
    (5, 64),  # chunk larger than the batch
])
def test_chunking_is_equivalent(T, chunk):
    moe = MoEConfig(6, 2, 24, 16, dtype=torch.float32, quant=QuantConfig.fp8_per_token())
    x, w1, w2, tw, ti, qp = _problem(T, 6, 24, 16, 2, quant=moe.quant)
    whole = _kernel(moe, qp)(x, w1, w2, tw, ti)
    chunked = _kernel(moe, qp, chunk_size=chunk, workspaces=WorkspaceCache(poison=float("nan")))
    out = chunked(x, w1, w2, tw, ti, output=torch.full_like(x, float("nan")))
    assert torch.allclose(out, whole, atol=1e-6, rtol=1e-6)


# ---- kernel features ---------------------------------------------------------------------

@pytest.mark.parametrize("batched", [False, True])
def test_zero_tokens(batched):
    moe = MoEConfig(4, 2, 16, 8, dtype=torch.float32)
    x, w1, w2, tw, ti, qp = _problem(0, 4, 16, 8, 2)
    out = _kernel(moe, qp, batched=batched)(x, w1, w2, tw, ti)
    assert out.shape == (0, 16)


@pytest.mark.parametrize("batched", [False, True])
def test_apply_router_weight_on_input(batched):
    moe = MoEConfig(4, 1, 16, 8, dtype=torch.float32)
    x, w1, w2, tw, ti, qp = _problem(6, 4, 16, 8, 1)
    out = _kernel(moe, qp, batched=batched)(x, w1, w2, tw, ti, apply_router_weight_on_input=True)
    ref = moe_torch(x, w1, w2, tw, ti, apply_router_weight_on_input=True)
    assert _rel(out, ref) < F32_TOL
    # The weight enters before the nonlinearity, so it differs from weighting the output.
    assert _rel(out, moe_torch(x, w1, w2, tw, ti)) > 1e-3


@pytest.mark.parametrize("batched", [False, True])
def test_expert_map_drops_experts_held_elsewhere(batched):
    E, El = 6, 3
    x, w1, w2, tw, ti, qp = _problem(9, E, 16, 8, 2)
    held = torch.tensor([4, 0, 2])  # global ids of the local experts, in local order
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[held] = torch.arange(El, dtype=torch.int32)
    local_moe = MoEConfig(El, 2, 16, 8, dtype=torch.float32)
    qpl = MoEQuantParams(qp.config)
    kernel = _kernel(local_moe, qpl, batched=batched)
    out = kernel(x, w1[held], w2[held], tw, ti, global_num_experts=E, expert_map=expert_map)
    ref = moe_torch(x, w1[held], w2[held], tw, ti, expert_map=expert_map)
    assert _rel(out, ref) < F32_TOL
    # Routes to the other experts really were dropped.
    assert _rel(out, moe_torch(x, w1, w2, tw, ti)) > 1e-2


class _NoReceivePF(MoEPrepareAndFinalizeNoEP):
    """A NoEP PF whose dispatch completes in a receiver, to observe the shared-experts overlap."""

    def __init__(self, log):
        self.log = log

    def has_prepare_no_receive(self):
        return True

    def prepare_no_receive(self, *args, micro_batch=0):
        self.log.append("dispatch started")
        result = self.prepare(*args, micro_batch=micro_batch)

        def receive() -> PrepareResult:
            self.log.append("dispatch received")
            return result
        return receive


def test_shared_experts_run_while_dispatch_in_flight():
    moe = MoEConfig(4, 2, 16, 8, dtype=torch.float32)
    x, w1, w2, tw, ti, qp = _problem(5, 4, 16, 8, 2)
    log = []
    shared_lin = torch.nn.Linear(16, 16)

    def shared(h):
        log.append("shared experts")
        return shared_lin(h)

    pf = _NoReceivePF(log)
    kernel = FusedMoEModularKernel(pf, TorchExperts.for_prepare_finalize(moe, qp, pf), shared_experts=shared)
    shared_out, out = kernel(x, w1, w2, tw, ti)
    assert log == ["dispatch started", "shared experts", "dispatch received"]
    assert torch.allclose(shared_out, shared_lin(x))
    assert _rel(out, moe_torch(x, w1, w2, tw, ti)) < F32_TOL


def test_shared_experts_without_overlap():
    moe = MoEConfig(4, 2, 16, 8, dtype=torch.float32)
    x, w1, w2, tw, ti, qp = _problem(5, 4, 16, 8, 2)
    kernel = _kernel(moe, qp, shared_experts=lambda h: 2 * h)
    shared_out, out = kernel(x, w1, w2, tw, ti)
    assert torch.equal(shared_out, 2 * x)


# ---- errors ------------------------------------------------------------------------------

def test_mismatched_formats_are_rejected():
    moe = MoEConfig(4, 2, 16, 8)
    pf = MoEPrepareAndFinalizeNoEP.make(moe)
    with pytest.raises(ValueError) as info:
        FusedMoEModularKernel(pf, NaiveBatchedExperts(moe, MoEQuantParams()))
    assert "produces the standard activation format but NaiveBatchedExperts takes batched" in str(info.value)


BAD_FORWARD = [
    # (mutation of the inputs, text the error must contain)
    (lambda a: a.update(topk_ids=a["topk_ids"][:, :1], topk_weights=a["topk_weights"][:, :1],
                        apply_router_weight_on_input=False, x=a["x"][:2]),
     "must both be (2, topk)"),
    (lambda a: a.update(apply_router_weight_on_input=True), "apply_router_weight_on_input needs topk == 1, got topk (2)"),
    (lambda a: a.update(w1=a["w1"][:, :, :8]), "hidden size K (16) must match w1.size(2) (8)"),
    (lambda a: a.update(output=torch.empty(3, 3)), "output (3, 3)"),
]


@pytest.mark.parametrize("mutate,text", BAD_FORWARD)
def test_bad_forward_inputs(mutate, text):
    moe = MoEConfig(4, 2, 16, 8, dtype=torch.float32)
    x, w1, w2, tw, ti, qp = _problem(5, 4, 16, 8, 2)
    args = dict(x=x, w1=w1, w2=w2, topk_weights=tw, topk_ids=ti, apply_router_weight_on_input=False, output=None)
    mutate(args)
    with pytest.raises(ValueError) as info:
        _kernel(moe, qp)(args["x"], args["w1"], args["w2"], args["topk_weights"], args["topk_ids"],
                         apply_router_weight_on_input=args["apply_router_weight_on_input"], output=args["output"])
    assert text in str(info.value)


BAD_MOE_CONFIGS = [
    (dict(num_experts=63, parallel=ParallelConfig(ep_size=8)), "num_experts (63) must be divisible by ep_size (8)"),
    (dict(topk=9), "MoEConfig.topk (9) must be <= num_experts (8)"),
    (dict(dtype=torch.int8), "MoEConfig.dtype (torch.int8) must be one of ['bfloat16', 'float16', 'float32']"),
    (dict(hidden_dim=0), "MoEConfig.hidden_dim (0) must be an int >= 1"),
]


@pytest.mark.parametrize("kwargs,text", BAD_MOE_CONFIGS)
def test_bad_moe_configs(kwargs, text):
    base = dict(num_experts=8, topk=2, hidden_dim=16, intermediate_dim=8)
    base.update(kwargs)
    with pytest.raises(ValueError) as info:
        MoEConfig(**base)
    assert text in str(info.value)


@pytest.mark.parametrize("kwargs,text", [
    (dict(ep_size=0), "ParallelConfig.ep_size (0) must be an int >= 1"),
    (dict(ep_size=2, ep_rank=2), "ParallelConfig.ep_rank (2) must be in [0, ep_size=2)"),
])
def test_bad_parallel_configs(kwargs, text):
    with pytest.raises(ValueError) as info:
        ParallelConfig(**kwargs)
    assert text in str(info.value)


def test_activation_names():
    assert Activation.parse("gelu") is Activation.GELU
    with pytest.raises(ValueError, match=r"activation \('relu'\) must be one of \['silu', 'gelu', 'swigluoai'\]"):
        Activation.parse("relu")


def test_experts_refuse_mismatched_quant():
    moe = MoEConfig(4, 2, 16, 8, quant=QuantConfig.fp8_per_token())
    with pytest.raises(ValueError, match=r"quant.config \(unquantized\) must equal moe.quant \(fp8-token\)"):
        TorchExperts(moe, MoEQuantParams())


def test_ep_reference_pfs_refuse_world_size():
    moe = MoEConfig(4, 2, 16, 8, parallel=ParallelConfig(ep_size=2))
    for cls in (MoEPrepareAndFinalizeNoEP, BatchedPrepareAndFinalize):
        ok, reason = cls.supports(moe)
        assert not ok and "ep_size is 2" in reason
        with pytest.raises(ValueError, match="ep_size is 2"):
            cls.make(moe)


def test_batched_pf_rejects_too_many_tokens():
    moe = MoEConfig(4, 2, 16, 8, dtype=torch.float32, max_num_tokens=4)
    x, w1, w2, tw, ti, qp = _problem(5, 4, 16, 8, 2)
    with pytest.raises(ValueError, match=r"tokens \(5\) must be <= max_num_tokens \(4\)"):
        _kernel(moe, qp, batched=True)(x, w1, w2, tw, ti)
