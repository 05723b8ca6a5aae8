"""Unit tests of the vLLM plugin against real vLLM objects (no engine is started).

Skipped where vLLM is not installed (the main test environment); .ci/vllm_e2e.sh runs them in the
vLLM virtualenv. Covers: settings parsing, the version pin, PrepareAndFinalize selection from
vLLM's FusedMoEParallelConfig (including one made from vllm.config.ParallelConfig), layer
planning from vLLM's FusedMoEConfig, and the installed hook computing a layer through
moe-modular against the float32 oracle.
"""
from __future__ import annotations

import socket
import typing
from types import MappingProxyType

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/vllm_e2e.sh runs this in its virtualenv")

from vllm.config import ParallelConfig as VllmParallelConfig  # noqa: E402
from vllm.config.parallel import All2AllBackend  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FusedMoEConfig,
    FusedMoEParallelConfig,
    RoutingMethodType,
)

from moe_modular import registry  # noqa: E402
from moe_modular.config import Activation  # noqa: E402
from moe_modular.integrations import vllm as plugin  # noqa: E402
from moe_modular.integrations import vllm_fp8 as plugin_fp8  # noqa: E402
from moe_modular.integrations.vllm_kernel_adapter import VllmKernelAdapter  # noqa: E402
from moe_modular.integrations.vllm_plugin_settings import VllmPluginSettings  # noqa: E402
from moe_modular.quant import MoEQuantParams, QuantConfig, quantize_weights  # noqa: E402
from moe_modular.reference import moe_torch  # noqa: E402
from moe_modular.testing.common import tolerance  # noqa: E402

ON = VllmPluginSettings(enabled=True)


@pytest.fixture
def vllm_config():
    """vLLM's default config as the current one (its fused-MoE method reads it when built)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def mpc(tp=1, dp=1, ep=1, use_ep=False, backend="allgather_reducescatter", pcp=1, sp=1, eplb=False, ep_rank=0):
    """A real vLLM FusedMoEParallelConfig, laid out as FusedMoEParallelConfig.make would."""
    return FusedMoEParallelConfig(
        tp_size=tp, pcp_size=pcp, dp_size=dp, ep_size=ep, tp_rank=0, pcp_rank=0, dp_rank=0,
        ep_rank=ep_rank, sp_size=sp, use_ep=use_ep, all2all_backend=backend, enable_eplb=eplb,
    )


def vllm_moe(parallel=None, E=8, topk=2, K=64, N=32, dtype=torch.float32, activation=MoEActivation.SILU, **kw):
    """A real vLLM FusedMoEConfig."""
    parallel = parallel or FusedMoEParallelConfig.make_no_parallel()
    return FusedMoEConfig(
        num_experts=E, experts_per_token=topk, hidden_dim=K, intermediate_size=N * parallel.tp_size,
        num_local_experts=E // parallel.ep_size, num_logical_experts=E, activation=activation, device="cpu",
        routing_method=RoutingMethodType.Renormalize, moe_parallel_config=parallel, in_dtype=dtype, **kw,
    )


# ---- settings ---------------------------------------------------------------------------------
SETTINGS_CASES = [
    ({}, VllmPluginSettings(False, None)),                                   # nothing set: off
    ({"MOE_MODULAR_ENABLE": "1"}, VllmPluginSettings(True, None)),          # the documented switch
    ({"MOE_MODULAR_ENABLE": " TRUE "}, VllmPluginSettings(True, None)),     # case and blanks
    ({"MOE_MODULAR_ENABLE": "0"}, VllmPluginSettings(False, None)),         # explicit off
    ({"MOE_MODULAR_ENABLE": "1", "MOE_MODULAR_ALL2ALL_BACKEND": "nccl_all_to_all"},
     VllmPluginSettings(True, "nccl_all_to_all")),                            # backend override
    ({"MOE_MODULAR_ALL2ALL_BACKEND": "  "}, VllmPluginSettings(False, None)),  # blank override = unset
]


@pytest.mark.parametrize("environ,expected", SETTINGS_CASES)
def test_settings_from_environ(environ, expected):
    assert VllmPluginSettings.from_environ(environ) == expected


def test_settings_reject_unknown_value_naming_the_variable():
    with pytest.raises(ValueError, match=r"MOE_MODULAR_ENABLE \('maybe'\) must be one of"):
        VllmPluginSettings.from_environ({"MOE_MODULAR_ENABLE": "maybe"})


# ---- version pin --------------------------------------------------------------------------------
@pytest.mark.parametrize("version,ok", [
    ("0.32.0", True),        # the release run end to end
    ("0.32.3+cpu", True),    # a patch release with a local tag, same series
    ("0.33.0", True),        # checked against its sources
    ("0.34.1", True),        # checked against its sources (0.34.0)
    ("0.31.9", False),       # older series
    ("0.35.0", False),       # newer series
    ("not-a-version", False),  # unparsable
])
def test_version_pin(version, ok):
    if ok:
        plugin.check_vllm_version(version)
    else:
        with pytest.raises(RuntimeError, match=rf"supports vLLM 0\.32\.x, 0\.33\.x, 0\.34\.x .*runs vLLM {version}.*unset MOE_MODULAR_ENABLE"):
            plugin.check_vllm_version(version)


def test_installed_vllm_is_supported():
    plugin.check_vllm_version(vllm.__version__)


def test_register_fails_at_load_on_unsupported_version(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with pytest.raises(RuntimeError, match=r"runs vLLM 0\.99\.0"):
        plugin.register({"MOE_MODULAR_ENABLE": "1"})
    assert plugin.uninstall_hook() is False  # nothing was installed


def test_register_disabled_leaves_vllm_alone():
    plugin.register({})
    assert plugin.uninstall_hook() is False


# ---- PrepareAndFinalize selection -------------------------------------------------------------
EP_PF_REGISTRY = MappingProxyType({registry.NO_EP_BACKEND: registry.PREPARE_FINALIZE_BY_BACKEND[registry.NO_EP_BACKEND],
                                   "allgather_reducescatter": object, "nccl_all_to_all": object})
NO_EP_PF_REGISTRY = MappingProxyType({registry.NO_EP_BACKEND: registry.PREPARE_FINALIZE_BY_BACKEND[registry.NO_EP_BACKEND]})

SELECT_CASES = [
    # (parallel config, settings, PF registry, expected backend or None, reason fragment)
    (FusedMoEParallelConfig.make_no_parallel(), ON, EP_PF_REGISTRY, "none", ""),         # one rank
    (mpc(tp=2), ON, EP_PF_REGISTRY, "none", ""),                                            # TP only: TP-sharded N
    (mpc(ep=2, use_ep=True), ON, EP_PF_REGISTRY, "none", ""),                               # TP2+EP, one DP rank: tokens replicated
    (mpc(dp=2, ep=2, use_ep=True), ON, EP_PF_REGISTRY, "allgather_reducescatter", ""),      # DP2+EP: vLLM's default name mapped
    (mpc(dp=2, ep=2, use_ep=True, backend="naive"), ON, EP_PF_REGISTRY, None,
     "no expert-parallel PrepareAndFinalize for all2all backend 'naive'"),                 # mapped but not registered
    (mpc(dp=2, ep=2, use_ep=True, backend="deepep_v2"), ON, EP_PF_REGISTRY, None,
     "vLLM all2all backend ('deepep_v2') has no moe-modular counterpart"),                 # unmapped vLLM name
    (mpc(dp=2, ep=2, use_ep=True, backend="deepep_v2"), VllmPluginSettings(True, "nccl_all_to_all"),
     EP_PF_REGISTRY, "nccl_all_to_all", ""),                                               # override wins
    (mpc(dp=2, ep=2, use_ep=True), VllmPluginSettings(True, "none"), EP_PF_REGISTRY, None,
     "for all2all backend 'none'"),                                                        # override may not pick the 1-rank PF
    (mpc(dp=2, ep=2, use_ep=True), ON, NO_EP_PF_REGISTRY, None,
     "registered: []"),                                                                    # no EP PF registered at all
    (mpc(dp=2), ON, EP_PF_REGISTRY, None, "data parallel (dp_size=2) without --enable-expert-parallel"),
    (mpc(pcp=2, ep=2, use_ep=True), ON, EP_PF_REGISTRY, None, "pcp_size=2"),             # prefill context parallel
    (mpc(sp=2, tp=2), ON, EP_PF_REGISTRY, None, "sp_size=2"),                              # sequence parallel
]


@pytest.mark.parametrize("parallel,settings,pf_registry,expected,reason", SELECT_CASES)
def test_select_backend_from_vllm_parallel_config(monkeypatch, parallel, settings, pf_registry, expected, reason):
    monkeypatch.setattr(registry, "PREPARE_FINALIZE_BY_BACKEND", pf_registry)
    backend, why = plugin.select_backend(parallel, settings)
    assert backend == expected
    if expected is None:
        assert reason in why
    else:
        assert why == ""


@pytest.mark.parametrize("enable_ep", [False, True])
def test_select_backend_from_vllm_parallel_config_object(enable_ep):
    """The FusedMoEParallelConfig vLLM derives from its own ParallelConfig (one rank, so no
    process group is needed) selects the single-rank PF with or without --enable-expert-parallel."""
    pc = VllmParallelConfig(enable_expert_parallel=enable_ep, all2all_backend="allgather_reducescatter")
    moe_parallel = FusedMoEParallelConfig.make(tp_size_=1, pcp_size_=1, dp_size_=1, sp_size_=1, vllm_parallel_config=pc)
    assert plugin.select_backend(moe_parallel, ON) == (registry.NO_EP_BACKEND, "")


def test_all2all_map_uses_vllm_names_and_moe_modular_names():
    vllm_names = set(typing.get_args(All2AllBackend))
    from all2all.base import ALL2ALL_BACKENDS

    for vllm_name, ours in plugin.VLLM_TO_MOE_MODULAR_ALL2ALL.items():
        assert vllm_name in vllm_names, f"{vllm_name!r} is not a vLLM --all2all-backend name"
        assert ours in ALL2ALL_BACKENDS, f"{ours!r} is not a moe-modular all2all backend"


# ---- layer planning ---------------------------------------------------------------------------
PLAN_CASES = [
    # (FusedMoEConfig kwargs, plan kwargs, expected backend or "" when refused, reason fragment)
    ({}, {}, "none", ""),                                                            # plain fp32 SiLU layer
    ({"dtype": torch.bfloat16}, {}, "none", ""),                                     # bf16 activations
    ({"activation": MoEActivation.GELU}, {}, "none", ""),                            # gated GELU
    ({"parallel": mpc(ep=2, use_ep=True)}, {}, "none", ""),                          # TP2+EP local experts
    ({"parallel": mpc(dp=2, ep=2, use_ep=True, ep_rank=1)}, {"placement": "round_robin"},
     "allgather_reducescatter", ""),                                                  # DP2+EP dispatches
    ({"activation": MoEActivation.SWIGLUOAI}, {}, "", "activation ('swigluoai')"),   # gpt-oss activation
    ({"has_bias": True}, {}, "", "expert biases"),                                  # biased experts
    ({"is_lora_enabled": True}, {}, "", "LoRA"),                                    # LoRA
    ({"parallel": mpc(ep=2, use_ep=True, eplb=True)}, {}, "", "--enable-eplb"),    # EPLB
    ({}, {"global_num_experts": 10}, "", "redundant experts"),                       # E + redundant slots
    ({}, {"vllm_backend": "XPU"}, "", "vLLM backend XPU keeps weights"),     # transposed layout
    ({}, {"placement": "zigzag"}, "", "expert placement ('zigzag')"),               # unknown placement
    ({"parallel": mpc(dp=2)}, {}, "", "without --enable-expert-parallel"),          # DP without EP
]


@pytest.mark.parametrize("moe_kw,plan_kw,backend,reason", PLAN_CASES)
def test_plan_layer(moe_kw, plan_kw, backend, reason):
    moe = vllm_moe(**moe_kw)
    kw = {"vllm_backend": "CPU", "global_num_experts": moe.num_experts, **plan_kw}
    plan = plugin.plan_layer(moe, ON, **kw)
    if reason:
        assert not plan.supported and reason in plan.reason
        assert plan.moe is None
        return
    assert plan.supported, plan.reason
    assert plan.backend == backend
    assert plan.prepare_finalize_type is registry.prepare_finalize_type(backend)
    assert plan.moe.num_experts == moe.num_experts and plan.moe.topk == moe.experts_per_token
    assert plan.moe.intermediate_dim == moe.intermediate_size_per_partition
    assert plan.moe.dtype == moe.in_dtype
    mp = moe.moe_parallel_config
    if backend == registry.NO_EP_BACKEND:
        assert plan.moe.parallel.ep_size == 1  # no dispatch: the kernel runs on this rank's tokens
    else:
        assert (plan.moe.parallel.ep_size, plan.moe.parallel.ep_rank) == (mp.ep_size, mp.ep_rank)
        assert plan.moe.parallel.placement.value == kw.get("placement", "linear")
    assert plan.experts_type is registry.select_experts_type(plan.prepare_finalize_type.activation_format(), plan.moe, "cpu")


# ---- the hook, end to end on one layer ---------------------------------------------------------
class _Layer(torch.nn.Module):
    """The attributes vLLM's RoutedExperts gives UnquantizedFusedMoEMethod."""

    def __init__(self, moe, w13, w2, expert_map=None):
        super().__init__()
        self.moe_config = moe
        self.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
        self.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
        self.activation = moe.activation
        self.apply_router_weight_on_input = False
        self.global_num_experts = moe.num_experts
        self.expert_map = expert_map
        self.layer_name = "model.layers.0.mlp.experts"


HOOK_CASES = [
    # (T tokens, E, topk, K, N, dtype, local experts (None = all), activation)
    (5, 8, 2, 64, 32, torch.float32, None, MoEActivation.SILU),       # the e2e model's shape
    (1, 8, 2, 64, 32, torch.float32, None, MoEActivation.SILU),       # a single decode token
    (7, 5, 5, 64, 32, torch.float32, None, MoEActivation.GELU),       # topk = E, prime E, GELU
    (9, 8, 2, 64, 32, torch.bfloat16, None, MoEActivation.SILU),      # bf16
    (6, 8, 2, 64, 32, torch.float32, [4, 5, 6, 7], MoEActivation.SILU),  # EP rank 1 of 2: local experts via expert_map
]


@pytest.mark.parametrize("T,E,topk,K,N,dtype,local,act", HOOK_CASES)
def test_hook_runs_layer_through_moe_modular(vllm_config, T, E, topk, K, N, dtype, local, act):
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    torch.manual_seed(1000 + T * E + topk)
    ep = 1 if local is None else E // len(local)
    parallel = mpc(ep=ep, use_ep=ep > 1, ep_rank=0 if local is None else local[0] // len(local))
    moe = vllm_moe(parallel, E=E, topk=topk, K=K, N=N, dtype=dtype, activation=act)
    w13_all = (torch.randn(E, 2 * N, K) * 0.2).to(dtype)
    w2_all = (torch.randn(E, K, N) * 0.2).to(dtype)
    expert_map = None
    if local is None:
        w13, w2 = w13_all, w2_all
    else:
        w13, w2 = w13_all[local].clone(), w2_all[local].clone()
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(len(local), dtype=torch.int32)
    layer = _Layer(moe, w13, w2, expert_map)
    x = torch.randn(T, K).to(dtype)
    logits = torch.randn(T, E)
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, dim=-1), topk, dim=-1)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    topk_ids = topk_ids.to(torch.int32)

    assert plugin.install_hook(ON) is True
    try:
        assert plugin.install_hook(ON) is False  # idempotent: a second plugin load does nothing
        method = UnquantizedFusedMoEMethod(moe)
        method._init_moe_kernel(layer)
        assert isinstance(method.moe_kernel, VllmKernelAdapter)
        assert method.moe_kernel.output_is_reduced() is False  # vLLM all-reduces sharded outputs
        out = method.forward_native(layer, x, topk_weights, topk_ids, None, None)
    finally:
        assert plugin.uninstall_hook() is True
    assert method.moe_kernel.num_forward_calls == 1
    assert out.shape == (T, K) and out.dtype == dtype

    ours = {MoEActivation.SILU: Activation.SILU, MoEActivation.GELU: Activation.GELU}[act]
    ref = moe_torch(x.float(), w13_all.float(), w2_all.float(), topk_weights, topk_ids, activation=ours,
                    expert_map=expert_map)
    if expert_map is not None:
        # This rank's share: routes to its experts only (vLLM all-reduces the ranks' shares).
        keep = (expert_map.long()[topk_ids.long()] >= 0).float()
        ref = moe_torch(x.float(), w13_all.float(), w2_all.float(), topk_weights * keep, topk_ids, activation=ours)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2 ** -7 * 4}[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol * max(1.0, ref.abs().max().item()), rtol=tol)


def test_hook_falls_back_to_vllm_for_unsupported_layer(vllm_config):
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    moe = vllm_moe(activation=MoEActivation.SWIGLUOAI)
    layer = _Layer(moe, torch.randn(8, 64, 64) * 0.1, torch.randn(8, 64, 32) * 0.1)
    layer._expert_routing_tables = lambda: None
    plugin.install_hook(ON)
    try:
        method = UnquantizedFusedMoEMethod(moe)
        method._init_moe_kernel(layer)
    finally:
        plugin.uninstall_hook()
    assert method.moe_kernel is not None and not isinstance(method.moe_kernel, VllmKernelAdapter)


def test_adapter_rejects_other_activation():
    plan = plugin.plan_layer(vllm_moe(), ON, vllm_backend="CPU")
    adapter = plugin.build_adapter(plan)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"activation \('gelu'\) must be 'silu'"):
        adapter.apply(x, torch.zeros(8, 64, 64), torch.zeros(8, 64, 32), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int32),
                      MoEActivation.GELU, 8, None, False)


def test_build_adapter_refuses_refused_plan():
    plan = plugin.plan_layer(vllm_moe(has_bias=True), ON, vllm_backend="CPU")
    with pytest.raises(ValueError, match="expert biases"):
        plugin.build_adapter(plan)


# ---- fp8 layers: vLLM's fp8 methods, real objects, through the hooks -------------------------------
@pytest.fixture(scope="module")
def vllm_one_rank():
    """vLLM's distributed state over one gloo rank (its fp8 methods read the tensor-parallel size)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(1)
    yield


class _Fp8Layer(torch.nn.Module):
    """The attributes vLLM's RoutedExperts gives its fp8 methods (their create_weights adds the tensors)."""

    def __init__(self, moe, expert_map=None):
        super().__init__()
        self.moe_config = moe
        self.activation = moe.activation
        self.apply_router_weight_on_input = False
        self.global_num_experts = moe.num_experts
        self.local_num_experts = moe.num_local_experts
        self.intermediate_size_per_partition = moe.intermediate_size_per_partition
        self.expert_map = expert_map
        self.layer_name = "model.layers.0.mlp.experts"

    def _expert_routing_tables(self):
        return None


def _fp8_method(kind, moe, layer):
    """A real vLLM fp8 MoE method for `kind`, with its weights created on `layer`."""
    if kind.startswith("ct-"):
        from compressed_tensors.quantization import QuantizationArgs
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe. \
            compressed_tensors_moe_w8a8_fp8 import CompressedTensorsW8A8Fp8MoEMethod

        weight, act = {"ct-channel": (dict(strategy="channel"), dict(strategy="token", dynamic=True)),
                       "ct-block": (dict(strategy="block", block_structure=[128, 128]),
                                    dict(strategy="group", group_size=128, dynamic=True)),
                       "ct-tensor": (dict(strategy="tensor"), dict(strategy="tensor", dynamic=False))}[kind]
        method = CompressedTensorsW8A8Fp8MoEMethod(QuantizationArgs(num_bits=8, type="float", **weight),
                                                   QuantizationArgs(num_bits=8, type="float", **act), moe)
    else:
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod

        cfg = {"block": Fp8Config(activation_scheme="dynamic", weight_block_size=[128, 128]),
               "tensor": Fp8Config(activation_scheme="dynamic"),
               "tensor-static": Fp8Config(activation_scheme="static")}[kind]
        method = Fp8MoEMethod(cfg, layer)
    method.create_weights(layer, moe.num_local_experts, moe.hidden_dim, moe.intermediate_size_per_partition,
                          moe.in_dtype)
    return method


# The checkpoint's scheme per kind (what the test quantizes the weights with) and what moe-modular serves.
FP8_KINDS = {
    "block": QuantConfig.fp8_block((128, 128)),
    "tensor": QuantConfig.fp8_per_tensor(),
    "tensor-static": QuantConfig.fp8_per_tensor(static=True),
    "ct-channel": QuantConfig.fp8_per_token(),
    "ct-block": QuantConfig.fp8_block((128, 128)),
}


def _load_fp8_layer(kind, method, layer, w13_hp, w2_hp):
    """Quantize high-precision weights as the checkpoint would, load them into the layer's tensors and run
    vLLM's loading step. Per-tensor layers: vLLM's process_weights_after_loading first merges the gate and up
    scales and the per-expert input scales with vLLM's own ops (`_C::static_scaled_fp8_quant` is not in the CPU
    build), then calls _setup_kernel, the hook, with the merged (E,) scales and maxima: the test calls
    _setup_kernel with such tensors. Returns the name of the weight-scale tensors."""
    q = FP8_KINDS[kind]
    scale_name = "weight_scale_inv" if kind == "block" else "weight_scale"
    q13, s13 = quantize_weights(w13_hp, q)
    q2, s2 = quantize_weights(w2_hp, q)
    if q.weight.value == "per-tensor":
        El = w13_hp.size(0)
        a13 = torch.linspace(0.02, 0.03, El).max() if q.static_activation_scale else None  # |x| up to 13 fits
        a2 = torch.linspace(0.01, 0.02, El).max() if q.static_activation_scale else None
        if q.static_activation_scale:
            layer.w13_input_scale.data = a13
            layer.w2_input_scale.data = a2
        method._setup_kernel(layer, q13, q2, s13, s2, a13, a2)
        return scale_name
    layer.w13_weight.data.copy_(q13)
    layer.w2_weight.data.copy_(q2)
    getattr(layer, f"w13_{scale_name}").data.copy_(s13)
    getattr(layer, f"w2_{scale_name}").data.copy_(s2)
    method.process_weights_after_loading(layer)
    return scale_name


FP8_HOOK_CASES = [
    # (kind, T tokens, E, topk, K, N, activation dtype, local experts (None = all))
    ("block", 9, 8, 2, 256, 128, torch.bfloat16, None),        # DeepSeek-style 128 x 128 blocks
    ("block", 5, 8, 2, 384, 256, torch.float32, [4, 5, 6, 7]),  # EP rank 1 of 2, fp32 activations
    ("block", 1, 4, 4, 256, 128, torch.bfloat16, None),        # one decode token, topk = E
    ("tensor", 7, 8, 2, 128, 64, torch.bfloat16, None),        # per-tensor, gate/up scales merged by vLLM
    ("tensor-static", 6, 8, 2, 128, 64, torch.bfloat16, None),  # static input scales (max over experts)
    ("ct-channel", 8, 8, 2, 128, 64, torch.bfloat16, None),    # compressed-tensors channel + token
    ("ct-block", 4, 8, 2, 256, 128, torch.bfloat16, [0, 1, 2, 3]),  # compressed-tensors block, EP rank 0
]


@pytest.mark.parametrize("kind,T,E,topk,K,N,dtype,local", FP8_HOOK_CASES)
def test_fp8_hook_runs_layer_through_moe_modular(vllm_config, vllm_one_rank, kind, T, E, topk, K, N, dtype, local):
    torch.manual_seed(2000 + T * E + K)
    ep = 1 if local is None else E // len(local)
    parallel = mpc(ep=ep, use_ep=ep > 1, ep_rank=0 if local is None else local[0] // len(local))
    moe = vllm_moe(parallel, E=E, topk=topk, K=K, N=N, dtype=dtype)
    El = moe.num_local_experts
    expert_map = None
    if local is not None:
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(len(local), dtype=torch.int32)
    layer = _Fp8Layer(moe, expert_map)
    assert plugin.install_hook(ON) is True
    try:
        method = _fp8_method(kind, moe, layer)
        scale_name = _load_fp8_layer(kind, method, layer, torch.randn(El, 2 * N, K) * 0.2, torch.randn(El, K, N) * 0.2)
        assert isinstance(method.moe_kernel, VllmKernelAdapter), method.moe_kernel
        assert method.moe_kernel.kernel.fused_experts.quant.config == FP8_KINDS[kind]
        x = (torch.randn(T, K) * 2).to(dtype)
        x[0, :8] = torch.nan if T > 1 else x[0, :8]  # poisoned row: stays in its own row (and group)
        topk_weights, topk_ids = torch.topk(torch.softmax(torch.randn(T, E), dim=-1), topk, dim=-1)
        topk_ids = topk_ids.to(torch.int32)
        out = method.apply(layer, x, topk_weights, topk_ids, None, None)
    finally:
        assert plugin.uninstall_hook() is True
    assert method.moe_kernel.num_forward_calls == 1
    assert out.shape == (T, K) and out.dtype == dtype
    # The oracle on the layer's tensors as vLLM left them (scales of the scheme's layout, no copies made).
    q = FP8_KINDS[kind]
    static = (layer.w13_input_scale.reshape(1), layer.w2_input_scale.reshape(1)) if q.static_activation_scale else ()
    params = MoEQuantParams(q, getattr(layer, f"w13_{scale_name}"), getattr(layer, f"w2_{scale_name}"), *static)
    assert method.moe_kernel.kernel.fused_experts.quant.w1_scale is params.w1_scale
    keep = torch.ones_like(topk_weights)
    if expert_map is not None:  # this rank's share: routes to its experts only
        keep = (expert_map.long()[topk_ids.long()] >= 0).float()
    ref = moe_torch(x.float(), layer.w13_weight, layer.w2_weight, topk_weights * keep, topk_ids, quant=params,
                    expert_map=expert_map)
    rows = slice(1, None) if T > 1 else slice(None)
    if T > 1:
        assert torch.isnan(out[0]).any() and not torch.isnan(out[rows]).any()
    tol = tolerance(dtype, q)
    torch.testing.assert_close(out[rows].float(), ref[rows], atol=tol * max(1.0, ref[rows].abs().max().item()), rtol=tol)


FP8_REFUSALS = [
    ("ct-tensor", "compressed-tensors fp8 weights 'tensor'"),
]


@pytest.mark.parametrize("kind,reason", FP8_REFUSALS)
def test_fp8_scheme_refusals_name_the_scheme(vllm_config, vllm_one_rank, kind, reason):
    moe = vllm_moe(E=8, topk=2, K=128, N=128, dtype=torch.bfloat16)
    method = _fp8_method(kind, moe, _Fp8Layer(moe))
    quant, why = plugin_fp8.scheme_of_compressed_tensors_method(method)
    assert quant is None and reason in why


@pytest.mark.parametrize("block,scheme,reason", [
    ([128, 128], "dynamic", ""),
    ([128, 64], "dynamic", "only Bk = 128 is served"),   # activation groups of 128 against a block K of 64
    ([128, 128], "static", "need dynamic activation scales"),
])
def test_fp8_block_scheme_of_vllm_fp8_method(vllm_config, vllm_one_rank, block, scheme, reason):
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod

    moe = vllm_moe(E=8, topk=2, K=256, N=256, dtype=torch.bfloat16)
    method = Fp8MoEMethod(Fp8Config(activation_scheme="dynamic", weight_block_size=block), _Fp8Layer(moe))
    method.quant_config.activation_scheme = scheme
    quant, why = plugin_fp8.scheme_of_fp8_method(method)
    if reason:
        assert quant is None and reason in why
    else:
        assert quant == QuantConfig.fp8_block(tuple(block)) and why == ""


def test_fp8_plan_refuses_vllm_converted_weights(vllm_config):
    # vLLM's DeepGEMM / FlashInfer formats are not the checkpoint's: a rebuild on them stays on vLLM.
    plan = plugin.plan_layer(vllm_moe(K=256, N=128), ON, QuantConfig.fp8_block((128, 128)), vllm_backend="DEEPGEMM",
                             plain_backends=plugin.FP8_PLAIN_LAYOUT_BACKENDS)
    assert not plan.supported and "vLLM backend DEEPGEMM keeps weights in its own layout" in plan.reason
    plan = plugin.plan_layer(vllm_moe(K=256, N=128), ON, QuantConfig.fp8_block((128, 128)), vllm_backend="TRITON",
                             plain_backends=plugin.FP8_PLAIN_LAYOUT_BACKENDS)
    assert plan.supported and plan.moe.quant == QuantConfig.fp8_block((128, 128))


def test_build_adapter_needs_the_plans_scheme():
    plan = plugin.plan_layer(vllm_moe(K=256, N=128), ON, QuantConfig.fp8_block((128, 128)))
    with pytest.raises(ValueError, match=r"MoEQuantParams.w1_scale/w2_scale are required"):
        plugin.build_adapter(plan)
    with pytest.raises(ValueError, match=r"quant_params scheme \(unquantized\) must be the plan's"):
        plugin.build_adapter(plan, quant_params=MoEQuantParams())


def test_adapter_refuses_prequantized_input():
    adapter = plugin.build_adapter(plugin.plan_layer(vllm_moe(), ON))
    with pytest.raises(ValueError, match="a1q_scale"):
        adapter.apply(torch.randn(2, 64), torch.zeros(8, 64, 64), torch.zeros(8, 64, 32), torch.ones(2, 2),
                      torch.zeros(2, 2, dtype=torch.int32), MoEActivation.SILU, 8, None, False, a1q_scale=torch.ones(2, 1))


def test_fp8_rebuild_keeps_moe_modular_on_the_checkpoint_layout(vllm_config, vllm_one_rank):
    # vLLM rebuilds the kernel (_init_moe_kernel) after re-processing weights: the layer the plugin served keeps
    # moe-modular's kernel, over the same tensors.
    moe = vllm_moe(E=8, topk=2, K=256, N=128, dtype=torch.bfloat16)
    layer = _Fp8Layer(moe)
    assert plugin.install_hook(ON) is True
    try:
        method = _fp8_method("block", moe, layer)
        _load_fp8_layer("block", method, layer, torch.randn(8, 256, 256) * 0.2, torch.randn(8, 256, 128) * 0.2)
        first = method.moe_kernel
        method._init_moe_kernel(layer)
    finally:
        plugin.uninstall_hook()
    assert isinstance(method.moe_kernel, VllmKernelAdapter) and method.moe_kernel is not first
    assert method.moe_kernel.kernel.fused_experts.quant.w1_scale is layer.w13_weight_scale_inv
