"""Two micro-batches in flight on one PrepareAndFinalize instance, on gloo at world sizes 2 and 4.

Each PF returns what its finalize needs as PrepareResult.handle and keeps nothing between prepare and
finalize, and prepare's micro_batch picks the communication buffers; so two micro-batches can be between
prepare and finalize at once, as dual-batch overlap runs them. For every expert-parallel PF (DeepEP's two
and symmetric memory through their gloo stand-ins, tests/deepep_stand_in.py and test_symm_mem.py) this checks,
against the single-batch forward of the same kernel (and that one against the float32 oracle):
  - FusedMoEModularKernel.forward(..., micro_batches=2);
  - prepare / receive / experts / finalize of the two halves driven by hand, interleaved in both orders:
    A's receive, experts and finalize before B's (the kernel's order), and B's receive and experts first,
    then A's, with B finalized before A;
  - the errors of a finalize given no handle, another micro-batch's handle, or a micro_batch out of range.
Every output starts as NaN, so a row a PF forgets to write fails the comparison.

Shape legend: W world size, M_r tokens of rank r, A / B the first ceil(M_r / 2) rows and the rest,
K hidden, E global experts, El local experts, k topk.
"""
from __future__ import annotations

import math
import zlib
from typing import Any, Callable

import pytest
import torch

from all2all import symm_mem
from all2all.deepep import DeepEPHighThroughputManager, DeepEPLowLatencyManager
from moe_modular.config import Activation, MoEConfig, ParallelConfig
from moe_modular.experts.naive_batched_experts import NaiveBatchedExperts
from moe_modular.experts.torch_experts import TorchExperts
from moe_modular.interfaces import MICRO_BATCHES, ActivationFormat, PrepareResult
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.parallel_context import ParallelContext
from moe_modular.prepare_finalize.deepep_ht_prepare_and_finalize import DeepEPHTPrepareAndFinalize
from moe_modular.prepare_finalize.deepep_ll_prepare_and_finalize import DeepEPLLPrepareAndFinalize
from moe_modular.prepare_finalize.symm_mem_prepare_and_finalize import SymmMemPrepareAndFinalize
from moe_modular.quant import MoEQuantParams, QuantConfig
from moe_modular.reference import moe_torch
from moe_modular.routing import local_expert_ids, make_expert_map
from moe_modular.workspace import WorkspaceCache
from moe_modular.testing.common import tolerance
from tests.deepep_stand_in import make_stand_in
from moe_modular.testing.parallel_utils import parallel_launch
from tests.test_ep_prepare_finalize import BLOCK, EXPERTS_BY_FORMAT, PF_TYPES, Case, make_problem, rel_error
from tests.test_symm_mem import GlooSymmMemStandIn

LAUNCH_TIMEOUT_S = 240.0
SCHEMES = (QuantConfig(), BLOCK, QuantConfig.fp8_per_token())
# Tokens per rank: odd counts, a rank with one token (its B half is empty) and one with none.
TOKENS = {2: (7, 1), 4: (5, 0, 1, 6)}
CPU = torch.device("cpu")


class StandInManagers:
    """One manager per stand-in backend for the whole launch (a DeepEP low-latency Buffer is one per process)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.made: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        if name not in self.made:
            self.made[name] = {
                "deepep_ht": lambda: DeepEPHighThroughputManager(self.group, CPU, deep_ep_module=make_stand_in()),
                "deepep_ll": lambda: DeepEPLowLatencyManager(self.group, CPU, deep_ep_module=make_stand_in()),
                "symm_mem": lambda: symm_mem.SymmMemManager(self.group, CPU, backend=GlooSymmMemStandIn(self.group)),
            }[name]()
        return self.made[name]

    def destroy(self) -> None:
        for manager in self.made.values():
            manager.destroy()


# name -> (PF class, experts class, how it is built from (moe, context, stand-in managers))
PFS: dict[str, tuple[type, type, Callable[..., Any]]] = {
    **{name: (cls, EXPERTS_BY_FORMAT[cls.activation_format()], lambda moe, ctx, mgrs, cls=cls: cls.make(moe, ctx))
       for name, cls in PF_TYPES.items()},
    "deepep_ht": (DeepEPHTPrepareAndFinalize, TorchExperts,
                  lambda moe, ctx, mgrs: DeepEPHTPrepareAndFinalize(moe, mgrs.get("deepep_ht"))),
    "deepep_ll": (DeepEPLLPrepareAndFinalize, NaiveBatchedExperts,
                  lambda moe, ctx, mgrs: DeepEPLLPrepareAndFinalize(moe, mgrs.get("deepep_ll"))),
    "symm_mem": (SymmMemPrepareAndFinalize, TorchExperts,
                 lambda moe, ctx, mgrs: SymmMemPrepareAndFinalize(moe, mgrs.get("symm_mem"))),
}


class Layer:
    """One rank's layer of `case`: the PF and experts, the kernel over them, and this rank's inputs."""

    def __init__(self, name: str, case: Case, pgi, context: ParallelContext, managers: StandInManagers,
                 seed: int) -> None:
        W, rank = pgi.world_size, pgi.rank
        self.case, self.prob = case, make_problem(case, seed, W)
        if case.replicated:
            self.rows = slice(0, case.Ms[0])
        else:
            start = sum(case.Ms[:rank])
            self.rows = slice(start, start + case.Ms[rank])
        moe = MoEConfig(num_experts=case.E, topk=case.topk, hidden_dim=case.K, intermediate_dim=case.N,
                        dtype=case.dtype, quant=case.quant,
                        parallel=ParallelConfig(ep_size=W, ep_rank=rank, placement=case.placement),
                        max_num_tokens=max(max(case.Ms), 1))
        _, experts_cls, build = PFS[name]
        self.pf = build(moe, context, managers)
        held = local_expert_ids(case.E, W, rank, case.placement)
        q = self.prob.quant
        quant = MoEQuantParams(q.config, None if q.w1_scale is None else q.w1_scale[held],
                               None if q.w2_scale is None else q.w2_scale[held], q.a1_scale, q.a2_scale)
        self.fe = experts_cls.for_prepare_finalize(moe, quant, self.pf)
        self.kernel = FusedMoEModularKernel(self.pf, self.fe, workspaces=WorkspaceCache(poison=float("nan")),
                                            check_inputs=True)
        self.w1, self.w2 = self.prob.w1[held], self.prob.w2[held]
        self.expert_map = make_expert_map(case.E, W, rank, case.placement)
        self.x = self.prob.x[self.rows]
        self.tw, self.ti = self.prob.topk_weights[self.rows], self.prob.topk_ids[self.rows]

    def forward(self, two: bool) -> torch.Tensor:
        out = torch.full_like(self.x, float("nan"))
        self.kernel(self.x, self.w1, self.w2, self.tw, self.ti, activation=Activation.SILU,
                    global_num_experts=self.case.E, expert_map=self.expert_map, output=out,
                    micro_batches=2 if two else 1)
        return out

    def oracle(self) -> torch.Tensor:
        p = self.prob
        return moe_torch(p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, Activation.SILU, p.quant)[self.rows]

    def halves(self) -> tuple[slice, slice]:
        T = self.x.size(0)
        a = -(-T // 2)
        return slice(0, a), slice(a, T)

    def start(self, micro_batch: int, rows: slice) -> Callable[[], PrepareResult]:
        """Start the dispatch of `rows` as `micro_batch`; the receiver completes it."""
        args = (self.x[rows], self.tw[rows], self.ti[rows], self.case.E, self.expert_map, False, self.fe.quant)
        if self.pf.has_prepare_no_receive():
            return self.pf.prepare_no_receive(*args, micro_batch=micro_batch)
        prepared = self.pf.prepare(*args, micro_batch=micro_batch)
        return lambda: prepared

    def experts(self, prepared: PrepareResult, rows: slice) -> torch.Tensor:
        """The experts' output for one prepared micro-batch, in buffers of its own (NaN-poisoned)."""
        fe, a1q = self.fe, prepared.a1q
        ids = prepared.topk_ids if prepared.topk_ids is not None else self.ti[rows]
        weights = prepared.topk_weights if prepared.topk_weights is not None else self.tw[rows]
        E, expert_map = (self.w1.size(0), None) if prepared.topk_ids is not None else (self.case.E, self.expert_map)
        batched = fe.activation_formats()[0] is ActivationFormat.BatchedExperts
        M = a1q.size(1) if batched else a1q.size(0)
        s13, s2, s_out, ws_dtype = fe.workspace_shapes(M, self.w1.size(1), self.w1.size(2), ids.size(1), E,
                                                       self.w1.size(0), prepared.expert_tokens_meta)
        nan = float("nan")
        out = torch.full(s_out, nan, dtype=self.x.dtype)
        if M:
            fe.apply(out, a1q, self.w1, self.w2, weights, ids, Activation.SILU, E, expert_map, prepared.a1q_scale,
                     fe.quant.a2_scale, torch.full(s13, nan, dtype=ws_dtype), torch.full(s2, nan, dtype=ws_dtype),
                     prepared.expert_tokens_meta, False)
        return out

    def finalize(self, rows: slice, fused: torch.Tensor, prepared: PrepareResult, output: torch.Tensor) -> None:
        self.pf.finalize(output[rows], fused, self.tw[rows], self.ti[rows], False,
                         self.fe.finalize_weight_and_reduce_impl(), prepared.handle)


def by_hand(layer: Layer, b_first: bool) -> torch.Tensor:
    """Both micro-batches started, then A before B (the kernel's order) or B's receive and experts first and B
    finalized before A."""
    halves = layer.halves()
    out = torch.full_like(layer.x, float("nan"))
    receivers = [layer.start(mb, rows) for mb, rows in enumerate(halves)]
    if not b_first:
        for mb, rows in enumerate(halves):
            prepared = receivers[mb]()
            layer.finalize(rows, layer.experts(prepared, rows), prepared, out)
        return out
    prepared_b = receivers[1]()
    fused_b = layer.experts(prepared_b, halves[1])
    prepared_a = receivers[0]()
    fused_a = layer.experts(prepared_a, halves[0])
    layer.finalize(halves[1], fused_b, prepared_b, out)
    layer.finalize(halves[0], fused_a, prepared_a, out)
    return out


def handle_errors(layer: Layer) -> list[str]:
    """finalize without a handle, with the other micro-batch's, and a micro_batch out of range: each a ValueError
    naming what is wrong, raised before any collective."""
    failures = []
    a, b = layer.halves()
    receivers = [layer.start(mb, rows) for mb, rows in enumerate((a, b))]
    prepared = [r() for r in receivers]
    fused_a = layer.experts(prepared[0], a)
    out = torch.full_like(layer.x, float("nan"))
    expects = [("no handle", None, "needs the handle its prepare returned")]
    if b.stop - b.start != a.stop - a.start:  # else the two handles are of the same token count
        expects.append(("micro-batch B's handle", prepared[1].handle, "output has"))
    # These finalize calls fail before any collective, so a rank may skip one alone.
    for what, handle, message in expects:
        try:
            layer.pf.finalize(out[a], fused_a, layer.tw[a], layer.ti[a], False,
                              layer.fe.finalize_weight_and_reduce_impl(), handle)
        except ValueError as exc:
            if message not in str(exc):
                failures.append(f"finalize with {what}: unexpected message {exc}")
        else:
            failures.append(f"finalize with {what} was accepted")
    for mb, rows in enumerate((a, b)):  # finish both micro-batches so the next case starts clean
        layer.finalize(rows, layer.experts(prepared[mb], rows), prepared[mb], out)
    try:
        layer.pf.prepare(layer.x, layer.tw, layer.ti, layer.case.E, layer.expert_map, False, layer.fe.quant,
                         micro_batch=MICRO_BATCHES)
    except ValueError as exc:
        if f"micro_batch ({MICRO_BATCHES}) must be an int in [0, {MICRO_BATCHES})" not in str(exc):
            failures.append(f"micro_batch out of range: unexpected message {exc}")
    else:
        failures.append("micro_batch out of range was accepted")
    return failures


def _worker(pgi, seed0: int) -> None:
    context = ParallelContext.from_group(pgi.group, pgi.device)
    managers = StandInManagers(pgi.group)
    failures: list[str] = []
    try:
        i = 0
        for name in PFS:
            for quant in SCHEMES:
                Ms = (7,) if name == "slice" else TOKENS[pgi.world_size]
                case = Case(name, Ms, quant=quant, replicated=name == "slice")
                layer = Layer(name, case, pgi, context, managers, seed0 + i)
                i += 1
                tol = tolerance(case.dtype, case.quant)
                single = layer.forward(two=False)
                err = rel_error(single, layer.oracle())
                if not (math.isfinite(err) and err <= tol):
                    failures.append(f"{case.describe()}: single batch vs oracle {err:.3g} > {tol:.3g}")
                results = {"forward(micro_batches=2)": layer.forward(two=True),
                           "by hand, A then B": by_hand(layer, b_first=False),
                           "by hand, B first": by_hand(layer, b_first=True)}
                for what, out in results.items():
                    err = rel_error(out, single)
                    if not (math.isfinite(err) and err <= tol):
                        failures.append(f"{case.describe()}: {what} vs single batch {err:.3g} > {tol:.3g}")
                if quant == SCHEMES[0]:
                    failures += [f"{case.describe()}: {f}" for f in handle_errors(layer)]
    finally:
        managers.destroy()
        context.destroy()
    if failures:
        raise AssertionError(f"rank {pgi.rank}: {len(failures)} checks failed:\n" + "\n".join(failures))


@pytest.mark.parametrize("world_size", [2, 4], ids=["w2", "w4"])
def test_two_micro_batches_in_flight(world_size, request):
    seed0 = zlib.crc32(request.node.name.encode()) % 10_000 * 100
    parallel_launch(world_size, _worker, seed0, timeout_s=LAUNCH_TIMEOUT_S)


def test_no_prepare_finalize_keeps_per_forward_state():
    """No PF class sets a `_state` attribute: what finalize needs travels in PrepareResult.handle."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "moe_modular" / "prepare_finalize"
    offenders = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and isinstance(node.ctx, ast.Store) and node.attr.endswith("_state"):
                offenders.append(f"{path.name}:{node.lineno} self.{node.attr}")
    assert not offenders, f"PFs keeping per-forward state: {offenders}"


def test_symmetric_memory_keeps_a_dispatch_layout_per_micro_batch():
    assert MICRO_BATCHES <= symm_mem.LAYOUT_SLOTS


@pytest.mark.parametrize("bad", [0, 3, True, 1.0])
def test_micro_batches_out_of_range_is_refused(bad):
    from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP

    moe = MoEConfig(num_experts=4, topk=2, hidden_dim=16, intermediate_dim=8, dtype=torch.float32)
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), TorchExperts(moe, MoEQuantParams()))
    x = torch.randn(3, 16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"micro_batches \({bad!r}\) must be 1 or {MICRO_BATCHES}"):
        kernel(x, torch.randn(4, 16, 16), torch.randn(4, 16, 8), torch.full((3, 2), 0.5), ids, micro_batches=bad)


def test_no_ep_two_micro_batches_match_one():
    """The single-rank PF through the same path: two halves (one of them empty at T=1) give the one-batch result."""
    from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP

    moe = MoEConfig(num_experts=4, topk=2, hidden_dim=16, intermediate_dim=8, dtype=torch.float32)
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP(), TorchExperts(moe, MoEQuantParams()),
                                   workspaces=WorkspaceCache(poison=float("nan")))
    w1, w2 = torch.randn(4, 16, 16), torch.randn(4, 16, 8)
    for T in (1, 5):
        x = torch.randn(T, 16)
        tw, ti = torch.softmax(torch.randn(T, 4), -1).topk(2, dim=-1)
        one = kernel(x, w1, w2, tw, ti.to(torch.int32))
        two = kernel(x, w1, w2, tw, ti.to(torch.int32), micro_batches=2)
        assert torch.isfinite(one).all(), f"T={T}: the one-batch forward left NaN rows"
        # The halves are separate matmuls, so float32 sums may round differently: a norm-relative float32 tolerance.
        err, tol = rel_error(two, one), tolerance(torch.float32, QuantConfig())
        assert math.isfinite(err) and err <= tol, f"T={T}: two micro-batches vs one {err:.3g} > {tol:.3g}"
