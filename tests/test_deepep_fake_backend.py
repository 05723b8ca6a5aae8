"""The DeepEP managers and PrepareAndFinalize classes end to end on 2 gloo ranks, with the CPU
stand-in for deep_ep (tests/deepep_stand_in.py) in place of the library: handle-cache sharing,
destroy-once, buffer-size arithmetic, id remapping, hidden padding, quantization before / after
the dispatch, the receive hook, and the result against the float32 oracle."""
from __future__ import annotations

import os

import pytest
import torch

from all2all.deepep import (
    DeepEPBufferSizes,
    DeepEPHighThroughputManager,
    DeepEPHTBufferConfig,
    DeepEPLLBufferConfig,
    DeepEPLowLatencyManager,
    ht_buffer_sizes,
    ll_buffer_sizes,
)
from moe_modular.config import ExpertPlacement
from moe_modular.experts.naive_batched_experts import NaiveBatchedExperts
from moe_modular.experts.torch_experts import TorchExperts
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.prepare_finalize.deepep_ht_prepare_and_finalize import DeepEPHTPrepareAndFinalize
from moe_modular.prepare_finalize.deepep_ll_prepare_and_finalize import DeepEPLLPrepareAndFinalize
from moe_modular.quant import MoEQuantParams, QuantConfig
from moe_modular.reference import moe_torch
from moe_modular.routing import local_expert_ids, make_expert_map
from moe_modular.weight_and_reduce import TopKWeightAndReduceContiguous
from tests.deepep_stand_in import make_stand_in
from moe_modular.testing.common import Config, tolerance
from moe_modular.testing.parallel_utils import parallel_launch
from moe_modular.testing.runner import make_inputs, relative_error

CPU = torch.device("cpu")
W = 2


# ---- buffer-size arithmetic (no process group needed) --------------------------------------------
SIZE_CASES = [
    # (world size, hidden bytes): intranode -> NVLink only, 1 QP; spanning nodes -> RDMA too, num_sms/2 QPs
    (2, 512),
    (8, 14336),
    (16, 14336),
    (32, 4096),
]


@pytest.mark.parametrize("ws,hidden_bytes", SIZE_CASES)
def test_ht_buffer_sizes(ws, hidden_bytes):
    mod = make_stand_in()
    sizes = ht_buffer_sizes(mod, ws, DeepEPHTBufferConfig(hidden_bytes))
    d, c = mod.Buffer.get_dispatch_config(ws), mod.Buffer.get_combine_config(ws)
    assert sizes.num_nvl_bytes == max(d.get_nvl_buffer_size_hint(hidden_bytes, ws),
                                      c.get_nvl_buffer_size_hint(hidden_bytes, ws))
    assert sizes.num_nvl_bytes > d.get_nvl_buffer_size_hint(hidden_bytes, ws)  # the combine hint is larger here
    assert not sizes.low_latency_mode
    if ws > 8:
        assert sizes.num_rdma_bytes == max(d.get_rdma_buffer_size_hint(hidden_bytes, ws),
                                           c.get_rdma_buffer_size_hint(hidden_bytes, ws)) > 0
        assert sizes.num_qps_per_rank == mod.Buffer.num_sms // 2
    else:
        assert (sizes.num_rdma_bytes, sizes.num_qps_per_rank) == (0, 1)


def test_ll_buffer_sizes():
    mod = make_stand_in()
    sizes = ll_buffer_sizes(mod, 4, DeepEPLLBufferConfig(128, 7168, 32))
    assert sizes == DeepEPBufferSizes(0, mod.Buffer.get_low_latency_rdma_size_hint(128, 7168, 4, 32), True, 8)
    with pytest.raises(ValueError, match=r"num_experts \(30\) must be divisible by ep_size \(4\)"):
        ll_buffer_sizes(mod, 4, DeepEPLLBufferConfig(128, 7168, 30))
    with pytest.raises(TypeError, match="DeepEPLLBufferConfig"):
        ll_buffer_sizes(mod, 4, DeepEPHTBufferConfig(512))


# ---- managers on 2 ranks ------------------------------------------------------------------------
def _inits(mod) -> list:
    return [e for e in mod.log if e[0] == "init"]


def _destroys(mod) -> list:
    return [e for e in mod.log if e[0] == "destroy"]


def _managers_worker(pgi) -> None:
    mod = make_stand_in()
    ht = DeepEPHighThroughputManager(pgi.group, CPU, deep_ep_module=mod)
    h = ht.get_handle(DeepEPHTBufferConfig(512))
    assert ht.get_handle(DeepEPHTBufferConfig(512)) is h, "one handle per config"
    h2 = ht.get_handle(DeepEPHTBufferConfig(1024))
    assert h2 is not h and len(_inits(mod)) == 2 and ht.num_handles == 2
    assert h.sizes == ht_buffer_sizes(mod, W, DeepEPHTBufferConfig(512))
    _, _, nvl, rdma, ll, qps, explicit = _inits(mod)[0]
    assert (nvl, rdma, ll, qps, explicit) == (h.sizes.num_nvl_bytes, 0, False, 1, True)

    # Two PFs of the same layer shape share the Buffer; a different hidden size gets its own.
    cfg = Config(Ms=(4,), K=96, N=32, E=8, topks=(2,), dtype=torch.bfloat16, quant=QuantConfig(),
                 prepare_finalize_type=DeepEPHTPrepareAndFinalize, fused_experts_type=TorchExperts, world_size=W)
    pf_a = DeepEPHTPrepareAndFinalize(cfg.moe_config(2, pgi.rank), ht)
    pf_b = DeepEPHTPrepareAndFinalize(cfg.moe_config(2, pgi.rank), ht)
    assert pf_a.handle is pf_b.handle and pf_a.handle is h  # K=96 pads to 256 bf16 = 512 bytes
    assert len(_inits(mod)) == 2

    # The inherited row exchange works alongside the DeepEP buffers (exchange semantics).
    rows = torch.arange(6 * 4, dtype=torch.int32).view(6, 4) + 100 * pgi.rank
    layout = ht.exchange_counts(torch.tensor([2, 4]) if pgi.rank == 0 else torch.tensor([3, 3]))
    got = ht.dispatch(h, rows, layout).wait()
    back = ht.combine(h, got, layout).wait()
    assert torch.equal(back, rows)

    ht.destroy()
    assert len(_destroys(mod)) == 2 and {d[1] for d in _destroys(mod)} == {i[1] for i in _inits(mod)}
    ht.destroy()
    assert len(_destroys(mod)) == 2, "destroyed once"
    assert h.destroyed and h.deep_ep_buffer is None
    try:
        ht.get_handle(DeepEPHTBufferConfig(512))
    except RuntimeError as exc:
        assert "destroyed" in str(exc)
    else:
        raise AssertionError("a destroyed manager must refuse new handles")

    # Low latency: RDMA from the hint, QPs = local experts, no NVLink bytes.
    ll_mod = make_stand_in(explicit_destroy=False)
    llm = DeepEPLowLatencyManager(pgi.group, CPU, deep_ep_module=ll_mod)
    lh = llm.get_handle(DeepEPLLBufferConfig(16, 2048, 8))
    assert llm.get_handle(DeepEPLLBufferConfig(16, 2048, 8)) is lh
    _, _, nvl, rdma, ll, qps, explicit = _inits(ll_mod)[0]
    assert (nvl, rdma, ll, qps, explicit) == (0, ll_mod.Buffer.get_low_latency_rdma_size_hint(16, 2048, W, 8),
                                              True, 4, False)
    llm.destroy()
    assert lh.destroyed and not _destroys(ll_mod)  # no destroy() on such builds: the reference is dropped

    # One low-latency Buffer per manager (one NVSHMEM initialisation): configs it covers share it, a larger
    # one is refused naming both, and a second Buffer in the process is refused by DeepEP itself.
    ll_mod = make_stand_in()
    llm = DeepEPLowLatencyManager(pgi.group, CPU, deep_ep_module=ll_mod)
    big = llm.get_handle(DeepEPLLBufferConfig(16, 4096, 8))
    small = llm.get_handle(DeepEPLLBufferConfig(8, 2048, 8))
    assert small is not big and small.deep_ep_buffer is big.deep_ep_buffer and len(_inits(ll_mod)) == 1
    try:
        llm.get_handle(DeepEPLLBufferConfig(32, 4096, 8))
    except ValueError as exc:
        assert "was built for DeepEPLLBufferConfig(max_dispatch_tokens_per_rank=16" in str(exc), str(exc)
        assert "initialise NVSHMEM again" in str(exc)
    else:
        raise AssertionError("a config the process's low-latency buffer does not cover must be refused")
    try:
        DeepEPLowLatencyManager(pgi.group, CPU, deep_ep_module=ll_mod).get_handle(DeepEPLLBufferConfig(8, 2048, 8))
    except RuntimeError as exc:
        assert "already initialised" in str(exc)
    else:
        raise AssertionError("the stand-in must refuse a second low-latency Buffer, as NVSHMEM does")
    llm.destroy()
    assert len(_destroys(ll_mod)) == 1, "the shared Buffer is destroyed once, by its owner"
    again = DeepEPLowLatencyManager(pgi.group, CPU, deep_ep_module=ll_mod)
    again.get_handle(DeepEPLLBufferConfig(8, 2048, 8))  # after destroy() a new Buffer may be built
    again.destroy()

    # Queue pairs NVSHMEM_QP_DEPTH deep hold 2 x (tokens + 1) work requests: more tokens are refused up front.
    os.environ["NVSHMEM_QP_DEPTH"] = "64"
    try:
        shallow = DeepEPLowLatencyManager(pgi.group, CPU, deep_ep_module=make_stand_in())
        try:
            shallow.get_handle(DeepEPLLBufferConfig(32, 2048, 8))
        except ValueError as exc:
            assert "must be <= 31 with NVSHMEM_QP_DEPTH 64" in str(exc) and "at least 66" in str(exc), str(exc)
        else:
            raise AssertionError("more tokens per rank than the queue pairs hold must be refused")
        shallow.get_handle(DeepEPLLBufferConfig(31, 2048, 8))
        shallow.destroy()
    finally:
        del os.environ["NVSHMEM_QP_DEPTH"]


def test_managers_share_handles_and_destroy_once():
    parallel_launch(W, _managers_worker, timeout_s=120)


def _rank_count_worker(pgi) -> None:
    mod = make_stand_in()
    sub = torch.distributed.new_group([0])
    if pgi.rank == 0:
        try:
            DeepEPHighThroughputManager(sub, CPU, deep_ep_module=mod)
        except ValueError as exc:
            assert "ep_size (1)" in str(exc) and "[2, 4, 8]" in str(exc), str(exc)
        else:
            raise AssertionError("one rank must be refused by the high-throughput manager")
        DeepEPLowLatencyManager(sub, CPU, deep_ep_module=mod).destroy()  # one rank is a valid LL Buffer
    try:
        DeepEPHighThroughputManager(pgi.group, CPU, deep_ep_module=None if _no_deep_ep() else mod)
    except RuntimeError as exc:
        assert "deep_ep is not installed" in str(exc)


def _no_deep_ep() -> bool:
    from all2all.deepep import load_deep_ep

    return load_deep_ep() is None


def test_rank_count_and_missing_module_fail_early():
    parallel_launch(W, _rank_count_worker, timeout_s=120)


# ---- PFs end to end -----------------------------------------------------------------------------
# Each case: (pf, scheme, K, E, topk, M, placement, options) and the edge it covers.
HT, LL = "ht", "ll"
PF_CASES = [
    (HT, QuantConfig(), 96, 8, 2, 5, ExpertPlacement.LINEAR, {}),                 # bf16, K padded 96 -> 256
    (HT, QuantConfig.fp8_block((128, 128)), 160, 8, 3, 4, ExpertPlacement.LINEAR, {}),  # fp8 before dispatch, partial group, K -> 512
    (HT, QuantConfig.fp8_per_tensor(), 128, 8, 2, 6, ExpertPlacement.LINEAR, {}),  # quantized after dispatch, global amax
    (HT, QuantConfig.fp8_per_token(), 256, 8, 2, 3, ExpertPlacement.ROUND_ROBIN, {}),  # ids remapped for round robin
    (HT, QuantConfig(), 64, 4, 1, 1, ExpertPlacement.LINEAR, {"on_input": True}),  # M=1, topk=1, weight on input
    (HT, QuantConfig(), 64, 8, 8, 3, ExpertPlacement.LINEAR, {}),                 # topk = E: every rank gets every token
    (LL, QuantConfig.fp8_block((128, 128)), 160, 8, 2, 5, ExpertPlacement.LINEAR, {}),  # DeepEP's fp8 dispatch, K -> 2048
    (LL, QuantConfig(), 96, 8, 3, 4, ExpertPlacement.ROUND_ROBIN, {}),            # bf16 dispatch (use_fp8=False)
    (LL, QuantConfig.fp8_per_tensor(), 128, 8, 2, 6, ExpertPlacement.LINEAR, {}),  # quantized after, stale slots masked
    (LL, QuantConfig.fp8_block((128, 128)), 128, 8, 2, 3, ExpertPlacement.LINEAR, {"shared": True}),  # receive hook
    (LL, QuantConfig.fp8_block((128, 128)), 128, 8, 2, 3, ExpertPlacement.LINEAR, {"first_release": True}),  # no use_fp8
    (LL, QuantConfig(), 64, 4, 1, 2, ExpertPlacement.LINEAR, {"on_input": True}),  # ones sent to the combine
]


def _run_pf_case(pgi, case, seed: int) -> tuple[float, float]:
    kind, quant_cfg, K, E, topk, M, placement, opts = case
    mod = make_stand_in(has_use_fp8=not opts.get("first_release", False))
    pf_cls, fe_cls, mgr_cls = ((DeepEPHTPrepareAndFinalize, TorchExperts, DeepEPHighThroughputManager) if kind == HT
                               else (DeepEPLLPrepareAndFinalize, NaiveBatchedExperts, DeepEPLowLatencyManager))
    cfg = Config(Ms=(M,), K=K, N=32, E=E, topks=(topk,), dtype=torch.bfloat16, quant=quant_cfg,
                 prepare_finalize_type=pf_cls, fused_experts_type=fe_cls, world_size=W, placement=placement)
    moe = cfg.moe_config(topk, pgi.rank)
    inp = make_inputs(cfg, M, topk, seed, CPU)
    rows = slice(pgi.rank * M, (pgi.rank + 1) * M)
    x, tw, ti = inp.x[rows], inp.topk_weights[rows], inp.topk_ids[rows]
    held = local_expert_ids(E, W, pgi.rank, placement)
    q = inp.quant
    pick = (lambda t: None if t is None else t[held])
    quant = MoEQuantParams(q.config, pick(q.w1_scale), pick(q.w2_scale), q.a1_scale, q.a2_scale)
    manager = mgr_cls(pgi.group, CPU, deep_ep_module=mod)
    pf = pf_cls(moe, manager)
    fe = fe_cls.for_prepare_finalize(moe, quant, pf)
    shared = (lambda h: h * 2) if opts.get("shared") else None
    kernel = FusedMoEModularKernel(pf, fe, shared_experts=shared)
    out = torch.full_like(x, float("nan"))
    on_input = opts.get("on_input", False)
    result = kernel(x, inp.w1[held], inp.w2[held], tw, ti, global_num_experts=E,
                    expert_map=make_expert_map(E, W, pgi.rank, placement), apply_router_weight_on_input=on_input,
                    output=out)
    if shared is not None:
        shared_out, _ = result
        assert torch.equal(shared_out, x * 2)
    ref = moe_torch(inp.x, inp.w1, inp.w2, inp.topk_weights, inp.topk_ids, cfg.activation, inp.quant,
                    apply_router_weight_on_input=on_input)[rows]
    manager.destroy()
    return relative_error(out, ref), tolerance(torch.bfloat16, quant_cfg)


def _pf_worker(pgi, cases) -> None:
    failures = []
    for i, case in enumerate(cases):
        err, tol = _run_pf_case(pgi, case, seed=1234 + i)
        if not err <= tol:
            failures.append(f"case {case[:7]}: relative error {err:.3g} > tolerance {tol:.3g}")
    assert not failures, "\n".join(failures)


def test_deepep_prepare_finalize_against_oracle():
    parallel_launch(W, _pf_worker, PF_CASES, timeout_s=240)


def _refusals_worker(pgi) -> None:
    first = make_stand_in(has_use_fp8=False)
    llm = DeepEPLowLatencyManager(pgi.group, CPU, deep_ep_module=first)
    cfg = Config(Ms=(2,), K=128, N=32, E=8, topks=(2,), dtype=torch.bfloat16, quant=QuantConfig(),
                 prepare_finalize_type=DeepEPLLPrepareAndFinalize, fused_experts_type=NaiveBatchedExperts,
                 world_size=W)
    try:
        DeepEPLLPrepareAndFinalize(cfg.moe_config(2, pgi.rank), llm)
    except ValueError as exc:
        assert "always casts to fp8" in str(exc)
    else:
        raise AssertionError("a deep_ep without use_fp8 cannot dispatch bf16")
    # Too many tokens for the low-latency buffer, and an impl that already weighted, are clear errors.
    mod = make_stand_in()
    pf = DeepEPLLPrepareAndFinalize(cfg.moe_config(2, pgi.rank), DeepEPLowLatencyManager(pgi.group, CPU, deep_ep_module=mod))
    x = torch.randn(3, 128).to(torch.bfloat16)
    ids = torch.zeros(3, 2, dtype=torch.int64)
    ids[:, 1] = 1
    try:
        pf.prepare(x, torch.ones(3, 2), ids, 8, None, False, MoEQuantParams())
    except ValueError as exc:
        assert "tokens (3) must be <= max_num_tokens (2)" in str(exc)
    else:
        raise AssertionError("more tokens than the buffer holds must be refused")
    prepared = pf.prepare(x[:2], torch.ones(2, 2), ids[:2], 8, None, False, MoEQuantParams())
    try:
        pf.finalize(torch.empty(2, 128, dtype=torch.bfloat16), torch.zeros(4, 4, 128), torch.ones(2, 2), ids[:2],
                    False, TopKWeightAndReduceContiguous(), prepared.handle)
    except ValueError as exc:
        assert "must be one of ['TopKWeightAndReduceDelegate', 'TopKWeightAndReduceNaiveBatched']" in str(exc)
    else:
        raise AssertionError("finalize must refuse an impl that weights outside DeepEP's combine")


def test_deepep_refusals():
    parallel_launch(W, _refusals_worker, timeout_s=120)
