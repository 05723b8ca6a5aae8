"""Run one combinations-matrix case: build seeded global inputs (every rank builds the same),
run this rank's share through a FusedMoEModularKernel with NaN-poisoned output and workspaces,
and compare with the float32 oracle.

Shape legend: W world size, M tokens per rank, K hidden, N intermediate, E global experts,
El local experts, k topk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from moe_modular.config import MoEConfig
from moe_modular.activation import act_and_mul_torch
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.quant import (
    MoEQuantParams,
    dequantize_weights,
    fake_quantize_activations,
    quantize_weights,
)
from moe_modular.reference import moe_torch
from moe_modular.routing import fused_topk, local_expert_ids, make_expert_map
from moe_modular.workspace import WorkspaceCache
from moe_modular.testing.common import Config, tolerance


@dataclass(frozen=True)
class MoEInputs:
    """Global inputs of one case: x_WMK (W*M, K), routing (W*M, k), weights for all E experts."""

    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    quant: MoEQuantParams


@dataclass(frozen=True)
class CaseResult:
    M: int
    topk: int
    rank: int
    error: float
    tolerance: float
    output: torch.Tensor

    @property
    def passed(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.tolerance


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def make_inputs(cfg: Config, M: int, topk: int, seed: int, device: torch.device) -> MoEInputs:
    """Seeded global inputs; the same seed gives the same tensors on every rank."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    T = cfg.world_size * M
    x = torch.randn((T, cfg.K), generator=g).to(cfg.dtype)
    logits = torch.randn((T, cfg.E), generator=g)
    topk_weights, topk_ids = fused_topk(x, logits, topk, renormalize=True)
    w1 = (torch.randn((cfg.E, 2 * cfg.N, cfg.K), generator=g) / math.sqrt(cfg.K)).to(cfg.dtype)
    w2 = (torch.randn((cfg.E, cfg.K, cfg.N), generator=g) / math.sqrt(cfg.N)).to(cfg.dtype)
    w1q, w1s = quantize_weights(w1, cfg.quant)
    w2q, w2s = quantize_weights(w2, cfg.quant)
    a1s = a2s = None
    if cfg.quant.static_activation_scale:
        a1s, a2s = _static_scales(x, topk_ids, w1q, w1s, cfg)
    quant = MoEQuantParams(cfg.quant, w1s, w2s, a1s, a2s)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return MoEInputs(
        x=x.to(device), topk_weights=topk_weights.to(device), topk_ids=topk_ids.to(device),
        w1=w1q.to(device), w2=w2q.to(device),
        quant=MoEQuantParams(cfg.quant, to(quant.w1_scale), to(quant.w2_scale), to(a1s), to(a2s)),
    )


def _static_scales(x, topk_ids, w1q, w1s, cfg: Config):
    """Calibrated static per-tensor scales: amax / 448 of the input and of the intermediate (1 / 448 for an
    empty batch: nothing to calibrate on, any positive scale serves)."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    xf = x.float()
    if xf.numel() == 0:
        one = torch.full((1,), 1.0 / fp8_max)
        return one, one.clone()
    a1s = (xf.abs().amax().clamp(min=1e-12) / fp8_max).reshape(1)
    params = MoEQuantParams(cfg.quant, w1s, w1s, a1s, a1s)
    xq = fake_quantize_activations(xf, params, a1s)
    w1 = dequantize_weights(w1q, w1s, cfg.quant)
    amax = torch.zeros(())
    for e in torch.unique(topk_ids).tolist():
        rows = (topk_ids == e).any(dim=1)
        h = act_and_mul_torch(xq[rows] @ w1[e].t(), cfg.activation)
        amax = torch.maximum(amax, h.abs().amax())
    a2s = (amax.clamp(min=1e-12) / fp8_max).reshape(1)
    return a1s, a2s


def _slice_experts(t: Optional[torch.Tensor], ids: torch.Tensor) -> Optional[torch.Tensor]:
    return None if t is None else t[ids]


def run_case(cfg: Config, M: int, topk: int, rank: int = 0, context=None, seed: int = 0,
             device: Optional[torch.device] = None, workspaces: Optional[WorkspaceCache] = None,
             around_forward: Optional[Callable[[Callable[[], None]], None]] = None) -> CaseResult:
    """Run this rank's M tokens of the case and compare them with the oracle.

    around_forward: when given, it is called with the forward (a callable that NaN-fills the
    output and runs the kernel once) instead of one plain call; it may call it any number of
    times (warm-up, profiling). The output of its last call is compared with the oracle."""
    device = device or default_device()
    moe: MoEConfig = cfg.moe_config(topk, rank)
    inp = make_inputs(cfg, M, topk, seed, device)
    rows = slice(rank * M, (rank + 1) * M)
    if cfg.prepare_finalize_type.expects_replicated_input():
        rows = slice(0, cfg.world_size * M)  # every rank holds the same (whole) batch
    x, tw, ti = inp.x[rows], inp.topk_weights[rows], inp.topk_ids[rows]

    expert_map = None
    w1, w2, quant = inp.w1, inp.w2, inp.quant
    if cfg.world_size > 1:
        held = local_expert_ids(cfg.E, cfg.world_size, rank, cfg.placement).to(device)
        expert_map = make_expert_map(cfg.E, cfg.world_size, rank, cfg.placement, device=device)
        w1, w2 = inp.w1[held], inp.w2[held]
        quant = MoEQuantParams(quant.config, _slice_experts(quant.w1_scale, held),
                               _slice_experts(quant.w2_scale, held), quant.a1_scale, quant.a2_scale)

    pf = cfg.prepare_finalize_type.make(moe, context)
    fe = cfg.fused_experts_type.for_prepare_finalize(moe, quant, pf)
    kernel = FusedMoEModularKernel(pf, fe, workspaces=workspaces or WorkspaceCache(poison=float("nan")),
                                   check_inputs=True)
    out = torch.full_like(x, float("nan"))

    def forward() -> None:
        out.fill_(float("nan"))
        kernel(x, w1, w2, tw, ti, activation=cfg.activation, global_num_experts=cfg.E,
               expert_map=expert_map, output=out)

    if around_forward is None:
        forward()
    else:
        around_forward(forward)

    ref = moe_torch(inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids, cfg.activation, inp.quant)[rows]
    return CaseResult(M, topk, rank, relative_error(out, ref), tolerance(cfg.dtype, cfg.quant), out.cpu())


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in out gives NaN; empty gives 0."""
    if out.numel() == 0:
        return 0.0
    o, r = out.double(), ref.double()
    if torch.isnan(o).any():
        return float("nan")
    return float((o - r).norm() / r.norm().clamp(min=1e-30))
