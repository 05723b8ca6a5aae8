"""parallel_launch failure handling: every rank's error is reported, nothing hangs.

The central case: one rank raises inside its experts in the middle of an EP forward while the
other ranks wait in the combine collective; every rank must exit within a bounded time and the
raised error must appear in the launch's exception.
"""
from __future__ import annotations

import time

import pytest
import torch

from moe_modular.config import MoEConfig, ParallelConfig
from moe_modular.experts.torch_experts import TorchExperts
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.parallel_context import ParallelContext
from moe_modular.prepare_finalize.all_to_all_prepare_and_finalize import AllToAllPrepareAndFinalize
from moe_modular.quant import MoEQuantParams
from moe_modular.testing.parallel_utils import ParallelLaunchError, parallel_launch

# Spawn + failure detection + grace; generous for a loaded 2-core machine, far below any hang.
BOUND_S = 120.0
GRACE_S = 5.0


class ExpertsThatRaise(TorchExperts):
    """TorchExperts whose apply raises on one chosen rank (after the dispatch has completed)."""

    failing_rank = 1

    def apply(self, *args, **kwargs):
        if self.moe.ep_rank == self.failing_rank:
            raise RuntimeError(f"injected expert failure on rank {self.moe.ep_rank}")
        return super().apply(*args, **kwargs)


def _worker_raise_mid_forward(pgi) -> None:
    context = ParallelContext.from_group(pgi.group, pgi.device)
    W, rank = pgi.world_size, pgi.rank
    E, K, N, T, k = 4 * W, 16, 8, 6, 2
    moe = MoEConfig(num_experts=E, topk=k, hidden_dim=K, intermediate_dim=N, dtype=torch.float32,
                    parallel=ParallelConfig(ep_size=W, ep_rank=rank), max_num_tokens=T)
    pf = AllToAllPrepareAndFinalize.make(moe, context)
    fe = ExpertsThatRaise.for_prepare_finalize(moe, MoEQuantParams(), pf)
    kernel = FusedMoEModularKernel(pf, fe)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, generator=g)
    El = E // W
    kernel(x, torch.randn(El, 2 * N, K), torch.randn(El, K, N), w, ids, global_num_experts=E)
    kernel(x, torch.randn(El, 2 * N, K), torch.randn(El, K, N), w, ids, global_num_experts=E)


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_raising_mid_forward_ends_every_rank(world_size):
    start = time.monotonic()
    with pytest.raises(ParallelLaunchError) as exc:
        parallel_launch(world_size, _worker_raise_mid_forward, timeout_s=BOUND_S, grace_s=GRACE_S)
    elapsed = time.monotonic() - start
    err = exc.value
    assert elapsed < BOUND_S, f"launch took {elapsed:.1f} s"
    assert "injected expert failure on rank 1" in err.failures[1]
    assert "--- rank 1 ---" in str(err) and "injected expert failure on rank 1" in str(err)
    # Every rank ended: with its own error (a peer's closed connection) or killed after the grace.
    assert set(err.failures) == set(range(world_size)), err.failures
    print(f"world size {world_size}: all ranks ended {elapsed:.1f} s after launch; "
          f"first failure reported: rank {next(iter(err.failures))}")


def _worker_one_hangs(pgi) -> None:
    if pgi.rank == 0:
        raise ValueError("rank 0 gives up")
    time.sleep(3600)  # never returns on its own; no collective will wake it


def test_hanging_rank_is_killed_after_grace():
    start = time.monotonic()
    with pytest.raises(ParallelLaunchError) as exc:
        parallel_launch(2, _worker_one_hangs, timeout_s=BOUND_S, grace_s=2.0)
    elapsed = time.monotonic() - start
    assert elapsed < BOUND_S
    assert "rank 0 gives up" in exc.value.failures[0]
    assert "killed 2 s after rank 0 failed" in exc.value.failures[1]


def _worker_sleep(pgi, seconds: float) -> None:
    time.sleep(seconds)


def test_timeout_kills_every_rank():
    start = time.monotonic()
    with pytest.raises(ParallelLaunchError) as exc:
        parallel_launch(2, _worker_sleep, 3600.0, timeout_s=8.0)
    assert time.monotonic() - start < 8.0 + 10.0
    assert all("timed out after 8 s" in exc.value.failures[r] for r in (0, 1))


def test_unpicklable_worker_is_refused_before_spawning():
    with pytest.raises(TypeError, match="must be a picklable module-level function"):
        parallel_launch(2, lambda pgi: None)
    with pytest.raises(ValueError, match=r"world_size \(0\) must be an int >= 1"):
        parallel_launch(0, _worker_sleep, 1.0)
