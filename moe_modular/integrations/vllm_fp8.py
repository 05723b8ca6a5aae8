"""vLLM's fp8 fused-MoE methods as moe-modular quantization schemes.

Two vLLM methods hold fp8 expert weights:
  Fp8MoEMethod (checkpoints with quant_method "fp8": DeepSeek-V3/R1, Qwen3-FP8; 128 x 128 block scales
    "weight_scale_inv" with 1 x 128 activation groups, or per-tensor "weight_scale" with dynamic or
    static per-tensor activation scales);
  CompressedTensorsW8A8Fp8MoEMethod (compressed-tensors checkpoints: per-channel weight scales with
    dynamic per-token activations, as Llama-4 FP8; or block scales).
`scheme_of_fp8_method` / `scheme_of_compressed_tensors_method` turn either into a QuantConfig (or the
reason there is none); `layer_quant_params` reads the layer's scale tensors, as vLLM loaded them, into
MoEQuantParams without copies.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from moe_modular.quant import MoEQuantParams, QuantConfig

# vLLM quantizes block-scaled activations in 1 x 128 groups (kFp8Dynamic128Sym); moe-modular's groups are the
# weight block's K, so the two agree only for a block K of 128.
VLLM_ACTIVATION_GROUP = 128

SchemeOrReason = tuple[Optional[QuantConfig], str]


def scheme_of_fp8_method(method: Any) -> SchemeOrReason:
    """The scheme of a vLLM Fp8MoEMethod: block (its moe_block_shape, the checkpoint's block adapted to tensor
    parallel sharding), else per-tensor with dynamic or static activation scales."""
    activation_scheme = method.quant_config.activation_scheme
    if method.block_quant:
        return _block_scheme(method.moe_block_shape, activation_scheme)
    if getattr(method, "per_act_token_quant", False):
        return None, ("fp8 per-tensor weights with per-token activations (VLLM_BATCH_INVARIANT) are not a "
                      "moe-modular scheme; supported: per-tensor activations with per-tensor weights, per-token "
                      "activations with per-channel weights")
    if activation_scheme == "static":
        return QuantConfig.fp8_per_tensor(static=True), ""
    if activation_scheme == "dynamic":
        return QuantConfig.fp8_per_tensor(), ""
    return None, f"fp8 activation_scheme ({activation_scheme!r}) is not supported; supported: ['dynamic', 'static']"


def scheme_of_compressed_tensors_method(method: Any) -> SchemeOrReason:
    """The scheme of a vLLM CompressedTensorsW8A8Fp8MoEMethod: per-channel weights with dynamic per-token
    activations, or block weights with dynamic 1 x 128 activation groups. Per-tensor compressed-tensors
    layers stay on vLLM's kernel: vLLM re-quantizes their gate and up halves to one scale inside its own
    loading step, which the plugin does not take over."""
    weight = str(getattr(method.weight_quant.strategy, "value", method.weight_quant.strategy))
    activation = str(getattr(method.input_quant.strategy, "value", method.input_quant.strategy))
    if weight == "channel" and activation == "token" and method.input_quant.dynamic:
        return QuantConfig.fp8_per_token(), ""
    if weight == "block":
        return _block_scheme(method.weight_block_size, "dynamic" if method.input_quant.dynamic else "static")
    return None, (f"compressed-tensors fp8 weights {weight!r} with activations {activation!r} "
                  f"(dynamic={method.input_quant.dynamic}) are not served; supported: weights 'channel' with "
                  f"dynamic 'token' activations, weights 'block' with dynamic activations")


def _block_scheme(block_shape: Any, activation_scheme: str) -> SchemeOrReason:
    if block_shape is None or len(block_shape) != 2:
        return None, f"fp8 weight block shape ({block_shape!r}) must be two ints [Bn, Bk]"
    bn, bk = (int(b) for b in block_shape)
    if activation_scheme != "dynamic":
        return None, f"fp8 block weights need dynamic activation scales, got activation_scheme {activation_scheme!r}"
    if bk != VLLM_ACTIVATION_GROUP:
        return None, (f"fp8 weight block [{bn}, {bk}]: vLLM quantizes activations in 1 x {VLLM_ACTIVATION_GROUP} "
                      f"groups and moe-modular's groups are the block's K, so only Bk = {VLLM_ACTIVATION_GROUP} "
                      f"is served")
    try:
        return QuantConfig.fp8_block((bn, bk)), ""
    except ValueError as exc:
        return None, str(exc)


def layer_quant_params(quant: QuantConfig, layer: torch.nn.Module, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                       ) -> MoEQuantParams:
    """MoEQuantParams over the layer's own tensors: the weight scales given (vLLM's w13_/w2_ weight_scale or
    weight_scale_inv, in vLLM's layout, which is moe-modular's) and, for static schemes, the layer's
    w13_input_scale / w2_input_scale as (1,) views."""
    a1 = a2 = None
    if quant.static_activation_scale:
        a1, a2 = layer.w13_input_scale.reshape(1), layer.w2_input_scale.reshape(1)
    return MoEQuantParams(quant, w13_scale, w2_scale, a1, a2)
