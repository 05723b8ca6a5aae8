"""What holds today and must stay true: bitwise run-to-run determinism of every experts class, world size 2 equal
to world size 1 within the format's tolerance, a rank killed with SIGKILL ending its peers within a bound, and
resident memory flat over many forwards of alternating sizes at world size 2."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from moe_modular.config import MoEConfig, ParallelConfig
from moe_modular.experts.batched_triton_experts import BatchedTritonExperts
from moe_modular.experts.grouped_mm_experts import GroupedMMExperts
from moe_modular.experts.naive_batched_experts import NaiveBatchedExperts
from moe_modular.experts.torch_experts import TorchExperts
from moe_modular.experts.triton_experts import TritonExperts
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.parallel_context import ParallelContext
from moe_modular.prepare_finalize.all_to_all_prepare_and_finalize import AllToAllPrepareAndFinalize
from moe_modular.prepare_finalize.batched import BatchedPrepareAndFinalize
from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
from moe_modular.quant import MoEQuantParams, QuantConfig, quantize_weights
from moe_modular.routing import local_expert_ids
from moe_modular.testing.common import tolerance
from moe_modular.testing.parallel_utils import ParallelLaunchError, parallel_launch

E, K, N, TOPK = 8, 32, 16, 2


def _weights(quant: QuantConfig, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    w1q, s1 = quantize_weights(torch.randn(E, 2 * N, K, generator=g) / K ** 0.5, quant)
    w2q, s2 = quantize_weights(torch.randn(E, K, N, generator=g) / N ** 0.5, quant)
    if not quant.is_quantized:
        w1q, w2q = w1q.to(torch.bfloat16), w2q.to(torch.bfloat16)
    return w1q, w2q, MoEQuantParams(quant, s1, s2)


def _tokens(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    tw, ti = torch.topk(logits.softmax(-1), TOPK)
    return x, tw.float(), ti.to(torch.int32)


@pytest.mark.parametrize("experts_cls", [TorchExperts, TritonExperts, GroupedMMExperts, NaiveBatchedExperts,
                                         BatchedTritonExperts], ids=lambda c: c.__name__)
@pytest.mark.parametrize("quant", [QuantConfig(), QuantConfig.fp8_block((32, 32))], ids=lambda q: q.name)
def test_every_experts_class_is_bitwise_deterministic(experts_cls, quant):
    moe = MoEConfig(num_experts=E, topk=TOPK, hidden_dim=K, intermediate_dim=N, quant=quant, max_num_tokens=9)
    ok, reason = experts_cls.supports(moe)
    if not ok:
        pytest.skip(reason)
    w1, w2, qp = _weights(quant)
    batched = experts_cls in (NaiveBatchedExperts, BatchedTritonExperts)
    pf = BatchedPrepareAndFinalize.make(moe) if batched else MoEPrepareAndFinalizeNoEP.make(moe)
    kernel = FusedMoEModularKernel(pf, experts_cls.for_prepare_finalize(moe, qp, pf))
    x, tw, ti = _tokens(9, seed=3)
    first = kernel(x, w1, w2, tw, ti).clone()
    for _ in range(2):
        assert torch.equal(kernel(x, w1, w2, tw, ti), first), "two runs on the same input differ"


# ---- world size 2 against world size 1 ------------------------------------------------------------
def _ws2_worker(pgi, T: int, out_path: str) -> None:
    ctx = ParallelContext.from_group(pgi.group, pgi.device)
    W, r = pgi.world_size, pgi.rank
    quant = QuantConfig.fp8_per_token()
    moe = MoEConfig(num_experts=E, topk=TOPK, hidden_dim=K, intermediate_dim=N, quant=quant, max_num_tokens=T,
                    parallel=ParallelConfig(W, r))
    w1, w2, qp = _weights(quant)
    held = local_expert_ids(E, W, r, moe.parallel.placement)
    qp_r = MoEQuantParams(quant, qp.w1_scale[held], qp.w2_scale[held])
    pf = AllToAllPrepareAndFinalize.make(moe, ctx)
    kernel = FusedMoEModularKernel(pf, TorchExperts.for_prepare_finalize(moe, qp_r, pf))
    x, tw, ti = _tokens(W * T, seed=11)
    rows = slice(r * T, (r + 1) * T)
    out = kernel(x[rows], w1[held], w2[held], tw[rows], ti[rows], global_num_experts=E)
    torch.save(out, f"{out_path}.{r}")
    ctx.destroy()


def test_world_size_two_equals_world_size_one(tmp_path):
    T = 5
    parallel_launch(2, _ws2_worker, T, str(tmp_path / "out"), timeout_s=120)
    ws2 = torch.cat([torch.load(tmp_path / f"out.{r}") for r in range(2)])
    quant = QuantConfig.fp8_per_token()
    moe = MoEConfig(num_experts=E, topk=TOPK, hidden_dim=K, intermediate_dim=N, quant=quant, max_num_tokens=2 * T)
    w1, w2, qp = _weights(quant)
    pf = MoEPrepareAndFinalizeNoEP.make(moe)
    x, tw, ti = _tokens(2 * T, seed=11)
    ws1 = FusedMoEModularKernel(pf, TorchExperts.for_prepare_finalize(moe, qp, pf))(x, w1, w2, tw, ti)
    err = float((ws2.float() - ws1.float()).norm() / ws1.float().norm())
    assert err <= tolerance(torch.bfloat16, quant), err


# ---- a rank killed outside the harness -----------------------------------------------------------
KILL_BOUND_S = 90.0


def _killed_worker(pgi) -> None:
    ctx = ParallelContext.from_group(pgi.group, pgi.device)
    moe = MoEConfig(num_experts=E, topk=TOPK, hidden_dim=K, intermediate_dim=N, dtype=torch.float32,
                    max_num_tokens=4, parallel=ParallelConfig(pgi.world_size, pgi.rank))
    pf = AllToAllPrepareAndFinalize.make(moe, ctx)
    kernel = FusedMoEModularKernel(pf, TorchExperts.for_prepare_finalize(moe, MoEQuantParams(), pf))
    El = E // pgi.world_size
    w1, w2 = torch.randn(El, 2 * N, K), torch.randn(El, K, N)
    x, tw, ti = _tokens(4, seed=pgi.rank)
    kernel(x.float(), w1, w2, tw, ti, global_num_experts=E)
    if pgi.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a user would
    for _ in range(1000):  # rank 0 waits in the next collectives for a peer that is gone
        kernel(x.float(), w1, w2, tw, ti, global_num_experts=E)


def test_a_rank_killed_by_sigkill_ends_its_peers_within_a_bound():
    start = time.monotonic()
    with pytest.raises(ParallelLaunchError) as exc:
        parallel_launch(2, _killed_worker, timeout_s=KILL_BOUND_S, grace_s=5.0)
    elapsed = time.monotonic() - start
    assert elapsed < KILL_BOUND_S, f"the peers of a killed rank ran {elapsed:.0f} s"
    assert 1 in exc.value.failures and 0 in exc.value.failures, exc.value.failures


# ---- memory over many forwards -------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_worker(pgi, forwards: int, out_path: str) -> None:
    ctx = ParallelContext.from_group(pgi.group, pgi.device)
    moe = MoEConfig(num_experts=E, topk=TOPK, hidden_dim=K, intermediate_dim=N, max_num_tokens=64,
                    parallel=ParallelConfig(pgi.world_size, pgi.rank))
    w1, w2, qp = _weights(QuantConfig())
    held = local_expert_ids(E, pgi.world_size, pgi.rank, moe.parallel.placement)
    pf = AllToAllPrepareAndFinalize.make(moe, ctx)
    kernel = FusedMoEModularKernel(pf, TorchExperts.for_prepare_finalize(moe, qp, pf))
    inputs = [_tokens(T, seed=T) for T in (1, 64, 7, 33)]
    samples = []
    for i in range(forwards):
        x, tw, ti = inputs[i % len(inputs)]
        kernel(x, w1[held], w2[held], tw, ti, global_num_experts=E)
        if i in (forwards // 4, forwards - 1):
            samples.append(_rss_bytes())
    torch.save(samples, f"{out_path}.{pgi.rank}")
    ctx.destroy()


def test_memory_stays_flat_over_forwards_of_alternating_sizes(tmp_path):
    parallel_launch(2, _rss_worker, 400, str(tmp_path / "rss"), timeout_s=240)
    for r in range(2):
        warm, end = torch.load(tmp_path / f"rss.{r}")
        assert end - warm < 16 << 20, f"rank {r}: resident memory grew {(end - warm) / 2**20:.1f} MiB"
