"""The vLLM plugin: vLLM's fused-MoE layers run through moe-modular's modular kernel.

Registered as a `vllm.general_plugins` entry point (`moe_modular = moe_modular.integrations.vllm:register`),
so vLLM calls `register()` in every process it starts (API server, engine core, workers).

Switches (read once, in `register`, from the environment):
  MOE_MODULAR_ENABLE=1               turn the plugin on (off when unset or 0).
  MOE_MODULAR_ALL2ALL_BACKEND=NAME   the moe-modular all2all backend for expert-parallel layers
                                     that dispatch (data parallel > 1 with --enable-expert-parallel);
                                     unset maps vLLM's --all2all-backend name (VLLM_TO_MOE_MODULAR_ALL2ALL).

How it hooks in: vLLM's UnquantizedFusedMoEMethod builds its kernel in `_init_moe_kernel(layer)`
after the weights are loaded. The plugin wraps that method: for each layer it plans a
PrepareAndFinalize + Experts pair (`plan_layer`); when one is found, `method.moe_kernel` becomes a
VllmKernelAdapter over moe-modular's FusedMoEModularKernel, and vLLM's CPU weight prepack is
skipped; otherwise vLLM's own kernel is built and the reason is logged once.

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

import os
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import torch

from moe_modular.config import SUPPORTED_DTYPES, Activation, ExpertPlacement, MoEConfig, ParallelConfig
from moe_modular.integrations.vllm_kernel_adapter import VllmKernelAdapter
from moe_modular.integrations.vllm_layer_plan import VllmLayerPlan
from moe_modular.integrations.vllm_plugin_settings import ENV_ALL2ALL_BACKEND, ENV_ENABLE, VllmPluginSettings
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.quant import MoEQuantParams, QuantConfig
from moe_modular import registry
from moe_modular.workspace import WorkspaceCache

LOGGER_NAME = "vllm.moe_modular"

# vLLM releases the hook was written against and tested with, as (major, minor) series.
SUPPORTED_VLLM_SERIES: tuple[tuple[int, int], ...] = ((0, 32),)
TESTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)

# vLLM --all2all-backend name -> moe-modular all2all backend name. vLLM names without an entry
# (deepep_v2, mori_*, moonep, nixl_ep, flashinfer_*, passthrough) have no moe-modular counterpart.
VLLM_TO_MOE_MODULAR_ALL2ALL: "MappingProxyType[str, str]" = MappingProxyType({
    "naive": "naive",
    "allgather_reducescatter": "allgather_reducescatter",
    "deepep_high_throughput": "deepep_high_throughput",
    "deepep_low_latency": "deepep_low_latency",
})

# vLLM MoEActivation value -> moe-modular Activation (gated activations with the same formula).
VLLM_ACTIVATIONS: "MappingProxyType[str, Activation]" = MappingProxyType({
    "silu": Activation.SILU,
    "gelu": Activation.GELU,
})

# vLLM unquantized backends whose weights stay in the checkpoint layout (w13 = [gate; up]).
PLAIN_LAYOUT_BACKENDS: frozenset[str] = frozenset({"CPU", "TRITON", "BATCHED_TRITON"})

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
            f"moe-modular's vLLM plugin supports vLLM {series} (tested: {', '.join(TESTED_VLLM_VERSIONS)}); "
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


def plan_layer(vllm_moe: Any, settings: VllmPluginSettings, unquantized_backend: str,
               global_num_experts: Optional[int] = None, placement: str = "linear") -> VllmLayerPlan:
    """Plan one layer from vLLM's FusedMoEConfig `vllm_moe`.

    unquantized_backend: the name of vLLM's UnquantizedMoeBackend chosen for the layer (its weight
      layout must be the checkpoint's). global_num_experts: the layer's (with redundant experts).
    placement: vLLM's expert_placement_strategy ("linear" / "round_robin")."""
    refuse = VllmLayerPlan.refuse
    if unquantized_backend not in PLAIN_LAYOUT_BACKENDS:
        return refuse(f"vLLM backend {unquantized_backend} keeps weights in its own layout; "
                      f"supported: {sorted(PLAIN_LAYOUT_BACKENDS)}")
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
            quant=QuantConfig(),
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
                  layer_name: str = "") -> VllmKernelAdapter:
    """The kernel for a supported plan; `context` is the ParallelContext for expert-parallel PFs."""
    if not plan.supported:
        raise ValueError(f"cannot build a kernel for a refused plan: {plan.reason}")
    pf = plan.prepare_finalize_type.make(plan.moe, context)
    experts = plan.experts_type.for_prepare_finalize(plan.moe, MoEQuantParams(plan.moe.quant), pf)
    kernel = FusedMoEModularKernel(pf, experts, workspaces=workspaces)
    # A dispatching PF combines every rank's routes for this rank's tokens; the single-rank PF on a
    # sharded vLLM layer leaves partial sums that vLLM's runner all-reduces.
    reduced = plan.backend != registry.NO_EP_BACKEND
    return VllmKernelAdapter(kernel, plan.moe.activation, output_is_reduced=reduced, layer_name=layer_name)


def _ep_context(shared: dict, placement: ExpertPlacement):
    """One ParallelContext per process over vLLM's EP group (its managers serve every layer)."""
    ctx = shared.get("context")
    if ctx is None:
        from vllm.distributed import get_ep_group

        from moe_modular.parallel_context import ParallelContext

        ep = get_ep_group()
        ctx = ParallelContext(
            ep.device_group,
            parallel=ParallelConfig(ep_size=ep.world_size, ep_rank=ep.rank_in_group, placement=placement),
        )
        shared["context"] = ctx
    return ctx


def _make_init_moe_kernel(original: Callable, settings: VllmPluginSettings) -> Callable:
    # Per-process objects shared by every layer: one workspace cache, one EP context.
    shared: dict = {"workspaces": WorkspaceCache()}

    def _init_moe_kernel(self, layer) -> None:
        log = _logger()
        from vllm.config import get_current_vllm_config

        placement = getattr(get_current_vllm_config().parallel_config, "expert_placement_strategy", "linear")
        plan = plan_layer(
            self.moe, settings,
            unquantized_backend=self.unquantized_backend.name,
            global_num_experts=getattr(layer, "global_num_experts", None),
            placement=placement,
        )
        if not plan.supported:
            log.warning_once("moe-modular: a MoE layer stays on vLLM's kernel: %s", plan.reason)
            return original(self, layer)
        context = None
        if plan.prepare_finalize_type.requires_distributed():
            context = _ep_context(shared, plan.moe.parallel.placement)
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        self.moe_kernel = build_adapter(plan, context, shared["workspaces"], getattr(layer, "layer_name", ""))
        log.info_once("moe-modular: MoE layers run %s", plan.describe())

    setattr(_init_moe_kernel, _HOOK_MARK, True)
    _init_moe_kernel.__wrapped__ = original
    _init_moe_kernel.__doc__ = "moe-modular's kernel when the layer has a supported pair, else vLLM's."
    return _init_moe_kernel


def install_hook(settings: VllmPluginSettings) -> bool:
    """Wrap UnquantizedFusedMoEMethod._init_moe_kernel (once per process); False if already wrapped."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as ufm

    cls = getattr(ufm, "UnquantizedFusedMoEMethod", None)
    original = getattr(cls, "_init_moe_kernel", None)
    if cls is None or not callable(original):
        raise RuntimeError(
            "moe-modular's vLLM plugin hooks vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method."
            "UnquantizedFusedMoEMethod._init_moe_kernel, which this vLLM does not have"
        )
    if getattr(original, _HOOK_MARK, False):
        return False
    cls._init_moe_kernel = _make_init_moe_kernel(original, settings)
    return True


def uninstall_hook() -> bool:
    """Restore vLLM's _init_moe_kernel; False if the hook was not installed."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as ufm

    current = ufm.UnquantizedFusedMoEMethod._init_moe_kernel
    if not getattr(current, _HOOK_MARK, False):
        return False
    ufm.UnquantizedFusedMoEMethod._init_moe_kernel = current.__wrapped__
    return True


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
