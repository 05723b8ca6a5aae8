"""Quantization schemes and their torch quantize / dequantize helpers.

Shape legend used in this module:
  T tokens, K hidden (reduction) dim, N output dim of a weight, E experts,
  G number of 1xB groups along K, Bn x Bk a weight block.

Scales are always float32 and always *multiplied* to dequantize: x ~= xq * scale.

Scheme layouts (activation scale / weight scale):
  per-tensor      a: (1,)           w: (E,)
  per-token       a: (T, 1)         w (per-channel): (E, N, 1)
  group / block   a: (T, ceil(K/Bk)) w (block):       (E, ceil(N/Bn), ceil(K/Bk))
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from moe_modular.fp8_format import FP8_DTYPE, FP8_MAX, MIN_AMAX


class QuantDtype(enum.Enum):
    """Number format of quantized activations and weights."""

    NONE = "none"
    FP8_E4M3 = "fp8"


class ActivationQuant(enum.Enum):
    """How activation scales are laid out."""

    NONE = "none"
    PER_TENSOR = "per-tensor"
    PER_TOKEN = "per-token"
    GROUP = "group"  # 1 x block_shape[1] groups along K


class WeightQuant(enum.Enum):
    """How weight scales are laid out."""

    NONE = "none"
    PER_TENSOR = "per-tensor"
    PER_CHANNEL = "per-channel"
    BLOCK = "block"  # block_shape[0] x block_shape[1] tiles


# The (activation, weight) pairs that form a scheme, keyed by a short name.
_SCHEME_NAMES: dict[tuple[QuantDtype, ActivationQuant, WeightQuant], str] = {
    (QuantDtype.NONE, ActivationQuant.NONE, WeightQuant.NONE): "unquantized",
    (QuantDtype.FP8_E4M3, ActivationQuant.PER_TENSOR, WeightQuant.PER_TENSOR): "fp8-tensor",
    (QuantDtype.FP8_E4M3, ActivationQuant.PER_TOKEN, WeightQuant.PER_CHANNEL): "fp8-token",
    (QuantDtype.FP8_E4M3, ActivationQuant.GROUP, WeightQuant.BLOCK): "fp8-block",
}


@dataclass(frozen=True)
class QuantConfig:
    """A quantization scheme (no tensors).

    Allowed schemes:
      unquantized                          (NONE, NONE, NONE)
      fp8 per-tensor, static or dynamic    (FP8_E4M3, PER_TENSOR, PER_TENSOR)
      fp8 per-token act + per-channel wt   (FP8_E4M3, PER_TOKEN, PER_CHANNEL)
      fp8 1xBk group act + BnxBk block wt  (FP8_E4M3, GROUP, BLOCK) with block_shape=(Bn, Bk)
    `static_activation_scale` (per-tensor only): activations use a precomputed scale
    (`a1_scale`, `a2_scale` in MoEQuantParams) instead of one computed per call.
    """

    quant_dtype: QuantDtype = QuantDtype.NONE
    activation: ActivationQuant = ActivationQuant.NONE
    weight: WeightQuant = WeightQuant.NONE
    block_shape: Optional[tuple[int, int]] = None
    static_activation_scale: bool = False

    def __post_init__(self) -> None:
        for name, enum_type in (
            ("quant_dtype", QuantDtype),
            ("activation", ActivationQuant),
            ("weight", WeightQuant),
        ):
            value = getattr(self, name)
            if not isinstance(value, enum_type):
                allowed = [m.value for m in enum_type]
                raise TypeError(f"QuantConfig.{name} ({value!r}) must be a {enum_type.__name__}, one of {allowed}")
        key = (self.quant_dtype, self.activation, self.weight)
        if key not in _SCHEME_NAMES:
            allowed = [f"({q.value}, {a.value}, {w.value})" for q, a, w in _SCHEME_NAMES]
            raise ValueError(
                f"QuantConfig (quant_dtype={self.quant_dtype.value}, activation={self.activation.value}, "
                f"weight={self.weight.value}) is not a supported scheme; allowed: {', '.join(allowed)}"
            )
        if self.weight is WeightQuant.BLOCK:
            bs = self.block_shape
            if (not isinstance(bs, tuple) or len(bs) != 2
                    or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in bs)):
                raise ValueError(
                    f"QuantConfig.block_shape ({bs!r}) must be a tuple of two positive ints (Bn, Bk) for weight=block"
                )
        elif self.block_shape is not None:
            raise ValueError(
                f"QuantConfig.block_shape ({self.block_shape!r}) is only allowed with weight=block, "
                f"not weight={self.weight.value}"
            )
        if self.static_activation_scale and self.activation is not ActivationQuant.PER_TENSOR:
            raise ValueError(
                f"QuantConfig.static_activation_scale (True) requires activation=per-tensor, "
                f"not activation={self.activation.value}"
            )

    # ---- constructors -------------------------------------------------------------
    @classmethod
    def unquantized(cls) -> "QuantConfig":
        return cls()

    @classmethod
    def fp8_per_tensor(cls, static: bool = False) -> "QuantConfig":
        return cls(QuantDtype.FP8_E4M3, ActivationQuant.PER_TENSOR, WeightQuant.PER_TENSOR,
                   static_activation_scale=static)

    @classmethod
    def fp8_per_token(cls) -> "QuantConfig":
        return cls(QuantDtype.FP8_E4M3, ActivationQuant.PER_TOKEN, WeightQuant.PER_CHANNEL)

    @classmethod
    def fp8_block(cls, block_shape: tuple[int, int] = (128, 128)) -> "QuantConfig":
        return cls(QuantDtype.FP8_E4M3, ActivationQuant.GROUP, WeightQuant.BLOCK, block_shape=tuple(block_shape))

    @classmethod
    def from_flags(
        cls,
        quant_dtype: Optional[str],
        per_token_quantized_activations: bool = False,
        per_channel_quantized_weights: bool = False,
        block_shape: Optional[tuple[int, int]] = None,
        static_activation_scale: bool = False,
    ) -> "QuantConfig":
        """Build a config from vLLM-style command-line flags."""
        allowed = [q.value for q in QuantDtype]
        if quant_dtype in (None, "none"):
            if per_token_quantized_activations or per_channel_quantized_weights or block_shape or static_activation_scale:
                raise ValueError(
                    "--quant-dtype (none) does not take --per-token-quantized-activations, "
                    "--per-channel-quantized-weights, --block-shape or --static-activation-scale; pass --quant-dtype fp8"
                )
            return cls()
        if static_activation_scale and (per_token_quantized_activations or per_channel_quantized_weights
                                        or block_shape is not None):
            raise ValueError("--static-activation-scale is for fp8 per-tensor scales; it cannot be combined with "
                             "--per-token-quantized-activations, --per-channel-quantized-weights or --block-shape")
        if quant_dtype not in allowed:
            raise ValueError(f"--quant-dtype ({quant_dtype!r}) must be one of {allowed}")
        if block_shape is not None:
            if per_token_quantized_activations or per_channel_quantized_weights:
                raise ValueError(
                    f"--block-shape ({list(block_shape)}) cannot be combined with per-token / per-channel flags"
                )
            return cls.fp8_block(tuple(int(b) for b in block_shape))
        if per_token_quantized_activations != per_channel_quantized_weights:
            raise ValueError(
                "--per-token-quantized-activations and --per-channel-quantized-weights go together "
                f"(got {per_token_quantized_activations} and {per_channel_quantized_weights})"
            )
        if per_token_quantized_activations:
            return cls.fp8_per_token()
        return cls.fp8_per_tensor(static=static_activation_scale)

    # ---- properties ---------------------------------------------------------------
    @property
    def name(self) -> str:
        base = _SCHEME_NAMES[(self.quant_dtype, self.activation, self.weight)]
        if self.weight is WeightQuant.BLOCK:
            base += f"{self.block_shape[0]}x{self.block_shape[1]}"
        if self.static_activation_scale:
            base += "-static"
        return base

    @property
    def is_quantized(self) -> bool:
        return self.quant_dtype is not QuantDtype.NONE

    @property
    def is_block(self) -> bool:
        return self.weight is WeightQuant.BLOCK

    @property
    def group_size(self) -> Optional[int]:
        return self.block_shape[1] if self.is_block else None

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class MoEQuantParams:
    """A scheme plus the scale tensors of one MoE layer.

    w1_scale / w2_scale: weight scales in the layout the scheme gives (module docstring), float32.
    a1_scale / a2_scale: static per-tensor activation scales (1,) float32, only with
      `static_activation_scale`; None otherwise (dynamic scales are computed per call).
    """

    config: QuantConfig = QuantConfig()
    w1_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    a1_scale: Optional[torch.Tensor] = None
    a2_scale: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        cfg = self.config
        if cfg.is_quantized and (self.w1_scale is None or self.w2_scale is None):
            raise ValueError(f"MoEQuantParams.w1_scale/w2_scale are required for scheme {cfg.name}")
        if not cfg.is_quantized and any(
            s is not None for s in (self.w1_scale, self.w2_scale, self.a1_scale, self.a2_scale)
        ):
            raise ValueError("MoEQuantParams scales must be None for the unquantized scheme")
        if cfg.static_activation_scale and (self.a1_scale is None or self.a2_scale is None):
            raise ValueError(f"MoEQuantParams.a1_scale/a2_scale are required for scheme {cfg.name}")
        if not cfg.static_activation_scale and (self.a1_scale is not None or self.a2_scale is not None):
            raise ValueError(
                f"MoEQuantParams.a1_scale/a2_scale are only for static per-tensor schemes, not {cfg.name}"
            )
        for name in ("w1_scale", "w2_scale", "a1_scale", "a2_scale"):
            scale = getattr(self, name)
            if scale is not None and (not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32):
                raise ValueError(f"MoEQuantParams.{name} must be a float32 tensor, got "
                                 f"{scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__}")
        for name in ("a1_scale", "a2_scale"):
            scale = getattr(self, name)
            if scale is None:
                continue
            if scale.numel() != 1:
                raise ValueError(f"MoEQuantParams.{name} must hold one per-tensor scale, got shape {tuple(scale.shape)}")
            # read once when the parameters are made (a load-time check, not in the forward)
            value = float(scale.reshape(()).item())
            if not (value > 0 and value < float("inf")):
                raise ValueError(f"MoEQuantParams.{name} ({value}) must be a finite scale > 0 (it multiplies "
                                 f"to dequantize: 0 gives zeros, a negative or NaN scale gives NaN)")

    def check_weights(self, w1: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> None:
        """w1 (El, 2N, K) and w2 (El, K, N) against the scheme (no device sync): fp8 e4m3 weights with scales of
        the scheme's layout on the weights' device, or, unquantized, weights of the activation dtype `dtype`."""
        cfg = self.config
        want = FP8_DTYPE if cfg.is_quantized else dtype
        for name, w in (("w1", w1), ("w2", w2)):
            if w.dtype != want:
                raise ValueError(f"{name} dtype ({w.dtype}) must be {want} for scheme {cfg.name}"
                                 + ("" if cfg.is_quantized else " (the activation dtype)"))
        if w1.device != w2.device:
            raise ValueError(f"w1 ({w1.device}) and w2 ({w2.device}) must be on one device")
        if not cfg.is_quantized:
            return
        for name, w, scale in (("w1", w1, self.w1_scale), ("w2", w2, self.w2_scale)):
            want_shape = weight_scale_shape(cfg, *w.shape)
            if tuple(scale.shape) != want_shape:
                raise ValueError(f"{name}_scale shape {tuple(scale.shape)} must be {want_shape} for {name} "
                                 f"{tuple(w.shape)} under scheme {cfg.name}")
            if scale.device != w.device:
                raise ValueError(f"{name}_scale ({scale.device}) must be on {name}'s device ({w.device})")


# ---- torch helpers ----------------------------------------------------------------

def weight_scale_shape(config: QuantConfig, E: int, No: int, Ko: int) -> tuple[int, ...]:
    """The scale shape of stacked weights (E, No, Ko) under a quantized scheme (module docstring): (E,) per-tensor,
    (E, No, 1) per-channel, (E, ceil(No / Bn), ceil(Ko / Bk)) block."""
    if config.weight is WeightQuant.PER_TENSOR:
        return (E,)
    if config.weight is WeightQuant.PER_CHANNEL:
        return (E, No, 1)
    if config.weight is WeightQuant.BLOCK:
        bn, bk = config.block_shape
        return (E, -(-No // bn), -(-Ko // bk))
    raise ValueError(f"weight_scale_shape: scheme {config.name} has no weight scales")


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The fp8 scale of an amax: max(amax, 1e-12) / 448, correctly rounded on every device, as the
    kernels compute it. (The divisor is a tensor: torch on CUDA turns a division by a Python scalar into
    a multiplication by its reciprocal, which can be a last bit off; one scale a bit off moves the
    rounding of its whole row or group, and the oracle then disagrees with the kernels.)"""
    a = amax.float().clamp(min=MIN_AMAX)
    return (a / torch.full_like(a, FP8_MAX)).to(torch.float32)


def _cast_fp8(x_scaled: torch.Tensor) -> torch.Tensor:
    """Saturated to +-448; an element that is not finite becomes NaN (so a non-finite input poisons its own
    row or group only, on every device: the kernels do the same)."""
    q = x_scaled.clamp(-FP8_MAX, FP8_MAX)
    return torch.where(torch.isfinite(x_scaled), q, torch.full_like(q, float("nan"))).to(FP8_DTYPE)


def finite_amax(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """max |x| over the finite elements (0 where there are none): a scale never comes from a NaN or Inf, so one
    non-finite element cannot change the quantization of the others sharing its scale."""
    a = torch.where(torch.isfinite(x), x.abs(), torch.zeros((), dtype=x.dtype, device=x.device))
    return a.amax() if dim is None else a.amax(dim=dim, keepdim=keepdim)


def quantize_activations(
    x_TK: torch.Tensor,
    config: QuantConfig,
    static_scale: Optional[torch.Tensor] = None,
    *,
    use_kernel: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Quantize activations x_TK (T, K) float to the scheme's format.

    Returns (xq_TK, scale): xq is fp8 e4m3 (T, K) (x_TK itself when unquantized) and scale is
    float32 (1,) / (T, 1) / (T, ceil(K/Bk)) for per-tensor / per-token / group, None when unquantized.
    CUDA tensors go through one Triton kernel (kernels/quant_fp8.py, the same bits) unless
    use_kernel is False; everything else, and the float32 oracle, through torch ops.
    """
    if not config.is_quantized:
        return x_TK, None
    static = config.activation is ActivationQuant.PER_TENSOR and config.static_activation_scale
    if static and static_scale is None:
        raise ValueError(f"a static activation scale is required for scheme {config.name}")
    if use_kernel and x_TK.is_cuda and x_TK.dim() == 2:
        quantized = _quantize_activations_triton(x_TK, config, static_scale)
        if quantized is not None:
            return quantized
    xf = x_TK.float()
    if config.activation is ActivationQuant.PER_TENSOR:
        if static:
            scale = static_scale.float().reshape(1)
        else:
            scale = scale_from_amax(finite_amax(xf).reshape(1)) if xf.numel() else torch.ones(
                1, dtype=torch.float32, device=x_TK.device)
        return _cast_fp8(xf / scale), scale
    if config.activation is ActivationQuant.PER_TOKEN:
        if xf.shape[0] == 0:
            return xf.to(FP8_DTYPE), torch.ones((0, 1), dtype=torch.float32, device=x_TK.device)
        scale = scale_from_amax(finite_amax(xf, dim=-1, keepdim=True))
        return _cast_fp8(xf / scale), scale
    # GROUP: 1 x Bk groups along K; the last group may be partial.
    bk = config.group_size
    T, K = xf.shape
    G = -(-K // bk)
    padded = torch.zeros((T, G * bk), dtype=torch.float32, device=x_TK.device)
    padded[:, :K] = xf
    groups = padded.view(T, G, bk)
    scale = scale_from_amax(finite_amax(groups, dim=-1)) if T else torch.ones(
        (0, G), dtype=torch.float32, device=x_TK.device)
    xq = _cast_fp8(groups / scale.unsqueeze(-1)).view(T, G * bk)[:, :K].contiguous()
    return xq, scale


def _quantize_activations_triton(
    x_TK: torch.Tensor, config: QuantConfig, static_scale: Optional[torch.Tensor]
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The same quantization by the Triton kernel of kernels/quant_fp8.py (one or two launches
    instead of a chain of torch ops), or None where triton is missing."""
    try:
        from moe_modular.kernels.quant_fp8 import Fp8Scaling, quantize_fp8
    except ImportError:
        return None
    if config.activation is ActivationQuant.PER_TOKEN:
        return quantize_fp8(x_TK, Fp8Scaling.TOKEN)
    if config.activation is ActivationQuant.GROUP:
        return quantize_fp8(x_TK, Fp8Scaling.GROUP, group_size=config.group_size)
    if config.static_activation_scale:
        return quantize_fp8(x_TK, Fp8Scaling.STATIC, static_scale=static_scale)
    return quantize_fp8(x_TK, Fp8Scaling.DYNAMIC)


def dequantize_activations(
    xq_TK: torch.Tensor, scale: Optional[torch.Tensor], config: QuantConfig
) -> torch.Tensor:
    """Inverse of quantize_activations, in float32 (T, K)."""
    if not config.is_quantized:
        return xq_TK.float()
    xf = xq_TK.float()
    if config.activation is ActivationQuant.GROUP:
        return xf * expand_group_scale(scale, xf.shape[-1], config.group_size)
    return xf * scale


def expand_group_scale(scale_TG: torch.Tensor, K: int, group: int) -> torch.Tensor:
    """(..., G) group scales to (..., K) per-element scales."""
    return scale_TG.repeat_interleave(group, dim=-1)[..., :K]


def quantize_weights(w_ENK: torch.Tensor, config: QuantConfig) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Quantize stacked expert weights w_ENK (E, N, K) float.

    Returns (wq_ENK fp8, scale): (E,) per-tensor, (E, N, 1) per-channel, (E, ceil(N/Bn), ceil(K/Bk))
    block. Unquantized returns (w_ENK, None).
    """
    if not config.is_quantized:
        return w_ENK, None
    wf = w_ENK.float()
    E, N, K = wf.shape
    if config.weight is WeightQuant.PER_TENSOR:
        scale = scale_from_amax(wf.abs().amax(dim=(1, 2)))
        return _cast_fp8(wf / scale.view(E, 1, 1)), scale
    if config.weight is WeightQuant.PER_CHANNEL:
        scale = scale_from_amax(wf.abs().amax(dim=2, keepdim=True))
        return _cast_fp8(wf / scale), scale
    bn, bk = config.block_shape
    Nb, Kb = -(-N // bn), -(-K // bk)
    padded = torch.zeros((E, Nb * bn, Kb * bk), dtype=torch.float32, device=w_ENK.device)
    padded[:, :N, :K] = wf
    blocks = padded.view(E, Nb, bn, Kb, bk)
    scale = scale_from_amax(blocks.abs().amax(dim=(2, 4)))  # (E, Nb, Kb)
    q = _cast_fp8(blocks / scale.view(E, Nb, 1, Kb, 1)).view(E, Nb * bn, Kb * bk)[:, :N, :K]
    return q.contiguous(), scale


def dequantize_weights(wq_ENK: torch.Tensor, scale: Optional[torch.Tensor], config: QuantConfig) -> torch.Tensor:
    """Inverse of quantize_weights, float32 (E, N, K)."""
    if not config.is_quantized:
        return wq_ENK.float()
    wf = wq_ENK.float()
    E, N, K = wf.shape
    if config.weight is WeightQuant.PER_TENSOR:
        return wf * scale.view(-1, 1, 1)
    if config.weight is WeightQuant.PER_CHANNEL:
        return wf * scale.view(E, N, 1)
    bn, bk = config.block_shape
    s = scale.repeat_interleave(bn, dim=1)[:, :N].repeat_interleave(bk, dim=2)[:, :, :K]
    return wf * s


def fake_quantize_activations(x_TK: torch.Tensor, params: "MoEQuantParams", static_scale=None) -> torch.Tensor:
    """Quantize then dequantize (float32), the oracle's model of activation quantization (torch ops)."""
    xq, s = quantize_activations(x_TK, params.config, static_scale, use_kernel=False)
    return dequantize_activations(xq, s, params.config)
