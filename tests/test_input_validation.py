"""Bad input never computes something else: each defect of the input-validation review, fed exactly that input.

Routing ids out of range: refused by FusedMoEModularKernel(check_inputs=True) (a device-to-host sync), else
dropped (the route contributes nothing) by every experts class, the float32 oracle included. Everything that
costs no sync (dtypes, shapes, devices, weights and scales against the scheme) is refused on every forward.
"""
from __future__ import annotations

import math

import pytest
import torch

from moe_modular.config import Activation, MoEConfig
from moe_modular.experts.batched_triton_experts import BatchedTritonExperts
from moe_modular.experts.grouped_mm_experts import GroupedMMExperts
from moe_modular.experts.naive_batched_experts import NaiveBatchedExperts
from moe_modular.experts.torch_experts import TorchExperts
from moe_modular.experts.triton_experts import TritonExperts
from moe_modular.fused_moe_layer import FusedMoE
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.prepare_finalize.batched import BatchedPrepareAndFinalize
from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
from moe_modular.quant import MoEQuantParams, QuantConfig, quantize_weights
from moe_modular.reference import moe_torch
from moe_modular.workspace import WorkspaceCache
from moe_modular.testing.common import tolerance

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
T, E, K, N, TOPK = 6, 4, 32, 16, 2


def _problem(dtype=torch.bfloat16, quant=QuantConfig(), seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ())))
    x = torch.randn(T, K, generator=g).to(dtype)
    w1q, s1 = quantize_weights(torch.randn(E, 2 * N, K, generator=g) / math.sqrt(K), quant)
    w2q, s2 = quantize_weights(torch.randn(E, K, N, generator=g) / math.sqrt(N), quant)
    if not quant.is_quantized:
        w1q, w2q = w1q.to(dtype), w2q.to(dtype)
    tw = torch.rand(T, TOPK, generator=g)
    ti = torch.randint(0, E, (T, TOPK), generator=g, dtype=torch.int32)
    dev = (lambda t: None if t is None else t.to(DEVICE))  # noqa: E731
    moe = MoEConfig(num_experts=E, topk=TOPK, hidden_dim=K, intermediate_dim=N, dtype=dtype, quant=quant,
                    max_num_tokens=T)
    return moe, dev(x), dev(w1q), dev(w2q), dev(tw), dev(ti), MoEQuantParams(quant, dev(s1), dev(s2))


def _kernel(moe, qp, experts_cls, **kw):
    batched = experts_cls in (NaiveBatchedExperts, BatchedTritonExperts)
    pf = BatchedPrepareAndFinalize.make(moe) if batched else MoEPrepareAndFinalizeNoEP.make(moe)
    return FusedMoEModularKernel(pf, experts_cls.for_prepare_finalize(moe, qp, pf),
                                 workspaces=WorkspaceCache(poison=float("nan")), **kw)


def _rel(out, ref):
    assert torch.isfinite(out).all(), "an output row was not written"
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


# ---- 1. routing ids ------------------------------------------------------------------------
# Ids out of range, written into valid routing: E and E + 5 (past the experts), -3 (negative, not the -1 of a
# route held elsewhere), and with an expert map a global id past the map.
BAD_IDS = [(0, 0, E), (1, 1, E + 5), (2, 0, -3), (4, 1, -1)]
EXPERTS = [TorchExperts, TritonExperts, GroupedMMExperts, NaiveBatchedExperts, BatchedTritonExperts]


@pytest.mark.parametrize("experts_cls", EXPERTS, ids=lambda c: c.__name__)
def test_out_of_range_routes_contribute_nothing_in_every_experts_class(experts_cls):
    moe, x, w1, w2, tw, ti, qp = _problem()
    ok, reason = experts_cls.supports(moe)
    if not ok:
        pytest.skip(reason)
    for t, j, bad in BAD_IDS:
        ti[t, j] = bad
    out = _kernel(moe, qp, experts_cls)(x, w1, w2, tw, ti)
    ref = moe_torch(x, w1, w2, tw, ti, Activation.SILU, qp)
    dropped = ti.clone().long()
    dropped[(ti < 0) | (ti >= E)] = 0
    kept = moe_torch(x, w1, w2, torch.where((ti >= 0) & (ti < E), tw, 0.0), dropped, Activation.SILU, qp)
    assert torch.allclose(ref, kept, rtol=1e-5, atol=1e-6), "the oracle must drop out-of-range routes"
    assert _rel(out, ref) <= tolerance(moe.dtype, moe.quant), f"{experts_cls.__name__} computed something else"


@pytest.mark.parametrize("experts_cls", [TorchExperts, TritonExperts, GroupedMMExperts], ids=lambda c: c.__name__)
def test_ids_past_the_expert_map_are_not_held(experts_cls):
    # global ids through an expert map: -1 (held elsewhere), an id past the map (E) and a negative one
    moe, x, w1, w2, tw, ti, qp = _problem()
    ok, reason = experts_cls.supports(moe)
    if not ok:
        pytest.skip(reason)
    expert_map = torch.tensor([0, -1, 1, -1], dtype=torch.int32, device=DEVICE)
    held = torch.tensor([0, 2])
    w1h, w2h = w1[held.to(DEVICE)], w2[held.to(DEVICE)]
    ti[0, 0], ti[3, 1], ti[5, 0] = E, -2, 1
    fe = experts_cls(moe, qp)
    kernel = FusedMoEModularKernel(MoEPrepareAndFinalizeNoEP.make(moe), fe,
                                   workspaces=WorkspaceCache(poison=float("nan")))
    out = kernel(x, w1h, w2h, tw, ti, global_num_experts=E, expert_map=expert_map)
    ref = moe_torch(x, w1h, w2h, tw, ti, Activation.SILU, qp, expert_map=expert_map)
    assert _rel(out, ref) <= tolerance(moe.dtype, moe.quant)


def test_check_inputs_refuses_ids_out_of_range_naming_them():
    moe, x, w1, w2, tw, ti, qp = _problem()
    ti[2, 1] = E + 3
    kernel = _kernel(moe, qp, TorchExperts, check_inputs=True)
    with pytest.raises(ValueError, match=rf"topk_ids hold 1 id\(s\) outside \[0, {E}\) \(global_num_experts\), "
                                         rf"e.g. \[{E + 3}\]"):
        kernel(x, w1, w2, tw, ti)
    ti[2, 1] = -1
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        kernel(x, w1, w2, tw, ti)


@pytest.mark.parametrize("ids_dtype", [torch.float32, torch.bool], ids=str)
def test_routing_ids_of_a_float_or_bool_dtype_are_refused(ids_dtype):
    moe, x, w1, w2, tw, ti, qp = _problem()
    with pytest.raises(ValueError, match=rf"topk_ids dtype \({ids_dtype}\) must be an integer dtype"):
        _kernel(moe, qp, TorchExperts)(x, w1, w2, tw, ti.to(ids_dtype))


def test_an_expert_map_of_the_wrong_length_is_refused():
    moe, x, w1, w2, tw, ti, qp = _problem()
    short = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"expert_map shape \(3,\) must be \(4,\)"):
        _kernel(moe, qp, TorchExperts)(x, w1, w2, tw, ti, global_num_experts=E, expert_map=short)


# ---- 4. weights and scales against the scheme ----------------------------------------------------
def test_weights_of_the_wrong_dtype_for_the_scheme_are_refused():
    moe, x, w1, w2, tw, ti, qp = _problem(quant=QuantConfig.fp8_per_token())
    kernel = _kernel(moe, qp, TorchExperts)
    with pytest.raises(ValueError, match=r"w1 dtype \(torch.bfloat16\) must be torch.float8_e4m3fn for scheme fp8-token"):
        kernel(x, w1.to(torch.bfloat16), w2, tw, ti)
    moe_u, x_u, w1_u, w2_u, tw_u, ti_u, qp_u = _problem()
    with pytest.raises(ValueError, match=r"w1 dtype \(torch.float8_e4m3fn\) must be torch.bfloat16 for scheme "
                                         r"unquantized \(the activation dtype\)"):
        _kernel(moe_u, qp_u, TorchExperts)(x_u, w1_u.to(torch.float8_e4m3fn), w2_u, tw_u, ti_u)


def test_weight_scales_of_the_wrong_shape_are_refused():
    moe, x, w1, w2, tw, ti, qp = _problem(quant=QuantConfig.fp8_block((16, 16)))
    bad = MoEQuantParams(qp.config, qp.w1_scale[:, :1], qp.w2_scale)
    with pytest.raises(ValueError, match=r"w1_scale shape \(4, 1, 2\) must be \(4, 2, 2\) for w1 \(4, 32, 32\) under "
                                         r"scheme fp8-block16x16"):
        _kernel(moe, bad, TorchExperts)(x, w1, w2, tw, ti)


@pytest.mark.parametrize("value,text", [(0.0, "0.0"), (-0.5, "-0.5"), (float("nan"), "nan"), (float("inf"), "inf")])
def test_static_activation_scales_must_be_finite_and_positive(value, text):
    quant = QuantConfig.fp8_per_tensor(static=True)
    s = torch.ones(E)
    with pytest.raises(ValueError, match=rf"MoEQuantParams.a1_scale \({text}\) must be a finite scale > 0"):
        MoEQuantParams(quant, s, s, torch.tensor([value]), torch.tensor([0.1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="weights on another device than the inputs need a GPU")
def test_weights_on_another_device_are_refused():
    moe, x, w1, w2, tw, ti, qp = _problem()
    with pytest.raises(ValueError, match="w1 is on cpu, hidden_states on cuda"):
        _kernel(moe, qp, TorchExperts)(x, w1.cpu(), w2.cpu(), tw, ti)


# ---- 5, 6, 9. the layer and its input --------------------------------------------------------------
def test_fused_moe_refuses_to_run_before_load_weights():
    layer = FusedMoE(MoEConfig(num_experts=E, topk=TOPK, hidden_dim=K, intermediate_dim=N))
    with pytest.raises(RuntimeError, match="before load_weights"):
        layer(torch.randn(3, K).to(torch.bfloat16))


@pytest.mark.parametrize("x,text", [
    (torch.randn(2, 3, K).to(torch.bfloat16), r"hidden_TK shape \(2, 3, 32\) must be \(T, 32\)"),
    (torch.randn(3, K), r"hidden_TK dtype \(torch.float32\) must be the layer's dtype \(torch.bfloat16\)"),
    (torch.ones(3, K, dtype=torch.int32), r"hidden_TK dtype \(torch.int32\) must be the layer's dtype"),
], ids=["3-D", "float32", "int32"])
def test_fused_moe_input_errors_name_the_input(x, text):
    layer = FusedMoE(MoEConfig(num_experts=E, topk=TOPK, hidden_dim=K, intermediate_dim=N))
    layer.load_weights(torch.randn(E, 2 * N, K), torch.randn(E, K, N))
    with pytest.raises(ValueError, match=text):
        layer(x)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float16], ids=str)
def test_hidden_states_of_another_dtype_are_refused_on_the_host(dtype):
    moe, x, w1, w2, tw, ti, qp = _problem()
    with pytest.raises(ValueError, match=rf"hidden_states dtype \({dtype}\) must be the layer's dtype"):
        _kernel(moe, qp, TritonExperts)(x.to(dtype), w1, w2, tw, ti)


# ---- 8, 9. configs ------------------------------------------------------------------------------
def test_moe_config_takes_the_activation_by_name():
    assert MoEConfig(num_experts=4, topk=2, hidden_dim=8, intermediate_dim=8, activation="gelu").activation \
        is Activation.GELU
    with pytest.raises(ValueError, match=r"activation \('relu'\) must be one of \['silu', 'gelu', 'swigluoai'\]"):
        MoEConfig(num_experts=4, topk=2, hidden_dim=8, intermediate_dim=8, activation="relu")


@pytest.mark.parametrize("shape", [[128, 128], (True, 128), (128.0, 128)], ids=["list", "bool", "float"])
def test_block_shape_must_be_a_tuple_of_ints(shape):
    from moe_modular.quant import ActivationQuant, QuantDtype, WeightQuant

    with pytest.raises(ValueError, match="QuantConfig.block_shape .* must be a tuple of two positive ints"):
        QuantConfig(QuantDtype.FP8_E4M3, ActivationQuant.GROUP, WeightQuant.BLOCK, block_shape=shape)


# ---- 10. workspaces ------------------------------------------------------------------------------
def test_a_slowly_growing_batch_reallocates_a_logarithmic_number_of_times():
    cache = WorkspaceCache()
    for n in range(1, 201):
        view = cache.get("ws", (n, 64), torch.float32, torch.device("cpu"))
        assert view.shape == (n, 64)
    assert cache.num_allocations <= 16, cache.num_allocations
    before = cache.num_allocations
    cache.get("ws", (150, 64), torch.float32, torch.device("cpu"))
    assert cache.num_allocations == before, "a smaller request reuses the buffer"


# ---- 7. the combinations CLI ---------------------------------------------------------------------
def test_cli_static_fp8_with_no_tokens_passes(capsys):
    from moe_modular.testing.cli import main

    rc = main(["--pf-type", "MoEPrepareAndFinalizeNoEP", "--experts-type", "TorchExperts", "-m", "0", "1",
               "--topk", "2", "--quant-dtype", "fp8", "--static-activation-scale"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS" in out and "M=0" in out and "1 passed, 0 failed" in out, out


def test_cli_whole_matrix_with_no_runnable_cell_is_not_a_pass(capsys):
    from moe_modular.testing.cli import main

    # world size 3 with 8 experts: no EP class takes it, and the single-device classes need 1 rank
    rc = main(["--world-size", "3", "--num-experts", "8", "-m", "1", "--topk", "1", "--dtype", "float32"])
    err = capsys.readouterr().err
    assert rc == 2 and "no cell of the request can run here" in err, err


@pytest.mark.parametrize("flags", [["--static-activation-scale"],
                                   ["--quant-dtype", "fp8", "--static-activation-scale", "--block-shape", "128", "128"],
                                   ["--quant-dtype", "fp8", "--static-activation-scale",
                                    "--per-token-quantized-activations", "--per-channel-quantized-weights"]],
                         ids=["no-quant-dtype", "block", "per-token"])
def test_cli_refuses_a_static_scale_it_would_ignore(flags, capsys):
    from moe_modular.testing.cli import main

    rc = main(["--pf-type", "MoEPrepareAndFinalizeNoEP", "--experts-type", "TorchExperts", "-m", "1", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and "--static-activation-scale" in err, err


# ---- 3. a non-finite token ------------------------------------------------------------------------
@pytest.mark.parametrize("experts_cls", [TorchExperts, TritonExperts], ids=lambda c: c.__name__)
@pytest.mark.parametrize("quant", [QuantConfig.fp8_per_token(), QuantConfig.fp8_block((32, 32)),
                                   QuantConfig.fp8_per_tensor()], ids=lambda q: q.name)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_token_poisons_only_its_own_row(experts_cls, quant, bad):
    # A scale's amax is over the finite elements and a non-finite element quantizes to NaN, in every scheme: the
    # token's own output row is not finite, every other row is what the oracle gives without it (a dynamic
    # per-tensor scale, an amax over the batch, is not moved by it either).
    moe, x, w1, w2, tw, ti, qp = _problem(quant=quant)
    x[3, 5] = bad
    out = _kernel(moe, qp, experts_cls)(x, w1, w2, tw, ti)
    others = torch.tensor([t for t in range(T) if t != 3], device=DEVICE)
    assert not torch.isfinite(out[3]).all(), "the non-finite token's row must not look valid"
    ref = moe_torch(x, w1, w2, tw, ti, Activation.SILU, qp)  # the oracle follows the same rule
    assert torch.isfinite(ref[others]).all() and not torch.isfinite(ref[3]).all()
    assert _rel(out[others], ref[others]) <= tolerance(moe.dtype, moe.quant)


# ---- 2. layer configs that differ across EP ranks ----------------------------------------------------
def _mismatch_worker(pgi, case: str) -> None:
    from moe_modular.config import ExpertPlacement, ParallelConfig
    from moe_modular.parallel_context import ParallelContext
    from moe_modular.prepare_finalize.all_to_all_prepare_and_finalize import AllToAllPrepareAndFinalize
    from moe_modular.prepare_finalize.naive_all2all_prepare_and_finalize import NaiveAll2AllPrepareAndFinalize

    ctx = ParallelContext.from_group(pgi.group, pgi.device)
    r = pgi.rank
    kw = dict(num_experts=8, topk=2, hidden_dim=32, intermediate_dim=16, dtype=torch.float32, max_num_tokens=4)
    pf_cls = AllToAllPrepareAndFinalize
    placement = ExpertPlacement.LINEAR
    if case == "hidden" and r == 1:
        kw["hidden_dim"] = 48
    if case == "intermediate+tokens" and r == 1:
        kw.update(intermediate_dim=24, max_num_tokens=8)
    if case == "placement" and r == 1:
        placement = ExpertPlacement.ROUND_ROBIN
    if case == "pf" and r == 1:
        pf_cls = NaiveAll2AllPrepareAndFinalize
    if case == "scheme" and r == 1:
        kw["quant"] = QuantConfig.fp8_per_token()
    moe = MoEConfig(**kw, parallel=ParallelConfig(pgi.world_size, r, placement))
    try:
        pf_cls.make(moe, ctx)
    except ValueError as exc:
        text = str(exc)
        assert "configured differently on the EP ranks" in text, text
        want = {"hidden": "hidden_dim: rank 0 = 32, rank 1 = 48",
                "intermediate+tokens": "intermediate_dim: rank 0 = 16, rank 1 = 24",
                "placement": "placement: rank 0 = linear, rank 1 = round_robin",
                "pf": "prepare_finalize: rank 0 = AllToAllPrepareAndFinalize, rank 1 = NaiveAll2AllPrepareAndFinalize",
                "scheme": "quant: rank 0 = unquantized, rank 1 = fp8-token"}[case]
        assert want in text, text
        if case == "intermediate+tokens":
            assert "max_num_tokens: rank 0 = 4, rank 1 = 8" in text, text
    else:
        raise AssertionError(f"rank {r}: a layer configured differently on the ranks ({case}) was accepted")
    finally:
        ctx.destroy()


@pytest.mark.parametrize("case", ["hidden", "intermediate+tokens", "placement", "pf", "scheme"])
def test_a_layer_configured_differently_on_the_ranks_fails_on_every_rank(case):
    from moe_modular.testing.parallel_utils import parallel_launch

    parallel_launch(2, _mismatch_worker, case, timeout_s=120)
