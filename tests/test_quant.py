"""Quantization schemes: construction errors, flag parsing, quantize/dequantize round trips."""
from __future__ import annotations

import pytest
import torch

from moe_modular.quant import (
    FP8_DTYPE,
    ActivationQuant,
    MoEQuantParams,
    QuantConfig,
    QuantDtype,
    WeightQuant,
    dequantize_activations,
    dequantize_weights,
    quantize_activations,
    quantize_weights,
)

# e4m3 keeps 3 mantissa bits: round-to-nearest error is at most half an ulp, 2^-4 relative.
FP8_HALF_ULP = 2.0 ** -4

ACT_CASES = [
    # (config, T, K): the edge each case covers
    (QuantConfig.fp8_per_tensor(), 7, 64),  # one scale for the whole tensor
    (QuantConfig.fp8_per_token(), 5, 33),  # a scale per row, odd K
    (QuantConfig.fp8_block((128, 128)), 3, 200),  # K not a multiple of the group: partial last group
    (QuantConfig.fp8_block((64, 32)), 1, 32),  # one token, exactly one group
    (QuantConfig.fp8_per_token(), 0, 16),  # no tokens
]


@pytest.mark.parametrize("cfg,T,K", ACT_CASES, ids=lambda v: str(v))
def test_activation_round_trip(cfg, T, K):
    x = torch.randn(T, K) * torch.logspace(-2, 2, K)  # a wide dynamic range across K
    xq, scale = quantize_activations(x, cfg)
    assert xq.dtype == FP8_DTYPE and xq.shape == (T, K)
    expected_scale_shape = {
        ActivationQuant.PER_TENSOR: (1,),
        ActivationQuant.PER_TOKEN: (T, 1),
        ActivationQuant.GROUP: (T, -(-K // (cfg.group_size or 1))),
    }[cfg.activation]
    assert tuple(scale.shape) == expected_scale_shape and scale.dtype == torch.float32
    back = dequantize_activations(xq, scale, cfg)
    # Each element is within half an fp8 ulp of itself, or below the format's resolution.
    bound = FP8_HALF_ULP * x.abs() + scale.max() * 2.0 ** -9 if T else 0
    assert torch.all((back - x).abs() <= bound)


WEIGHT_CASES = [
    (QuantConfig.fp8_per_tensor(), (3, 16, 24)),  # a scale per expert
    (QuantConfig.fp8_per_token(), (2, 9, 40)),  # per-channel: a scale per output row
    (QuantConfig.fp8_block((128, 128)), (2, 130, 260)),  # N and K not multiples of the block
    (QuantConfig.fp8_block((16, 32)), (1, 32, 64)),  # exact blocks
]


@pytest.mark.parametrize("cfg,shape", WEIGHT_CASES, ids=lambda v: str(v))
def test_weight_round_trip(cfg, shape):
    w = torch.randn(shape)
    wq, scale = quantize_weights(w, cfg)
    E, N, K = shape
    expected = {
        WeightQuant.PER_TENSOR: (E,),
        WeightQuant.PER_CHANNEL: (E, N, 1),
        WeightQuant.BLOCK: (E, -(-N // (cfg.block_shape or (1, 1))[0]), -(-K // (cfg.block_shape or (1, 1))[1])),
    }[cfg.weight]
    assert tuple(scale.shape) == expected
    back = dequantize_weights(wq, scale, cfg)
    rel = (back - w).norm() / w.norm()
    assert rel < FP8_HALF_ULP, rel


def test_unquantized_is_identity():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    xq, s = quantize_activations(x, QuantConfig())
    assert xq is x and s is None


def test_static_scale_is_used():
    cfg = QuantConfig.fp8_per_tensor(static=True)
    x = torch.randn(4, 8)
    scale = torch.tensor([0.5])
    xq, s = quantize_activations(x, cfg, scale)
    assert torch.equal(s, scale)
    assert torch.equal(xq, (x / 0.5).clamp(-448, 448).to(FP8_DTYPE))


BAD_CONFIGS = [
    # (kwargs, text the error must contain)
    (dict(quant_dtype=QuantDtype.FP8_E4M3, activation=ActivationQuant.PER_TOKEN, weight=WeightQuant.BLOCK,
          block_shape=(128, 128)), "is not a supported scheme"),
    (dict(quant_dtype=QuantDtype.FP8_E4M3, activation=ActivationQuant.GROUP, weight=WeightQuant.BLOCK),
     "QuantConfig.block_shape (None) must be a tuple of two positive ints"),
    (dict(block_shape=(128, 128)), "block_shape ((128, 128)) is only allowed with weight=block"),
    (dict(quant_dtype="fp8"), "QuantConfig.quant_dtype ('fp8') must be a QuantDtype"),
    (dict(quant_dtype=QuantDtype.FP8_E4M3, activation=ActivationQuant.PER_TOKEN,
          weight=WeightQuant.PER_CHANNEL, static_activation_scale=True),
     "static_activation_scale (True) requires activation=per-tensor"),
]


@pytest.mark.parametrize("kwargs,text", BAD_CONFIGS)
def test_bad_configs_name_the_field(kwargs, text):
    with pytest.raises((ValueError, TypeError)) as info:
        QuantConfig(**kwargs)
    assert text in str(info.value)


FLAG_CASES = [
    (dict(quant_dtype=None), "unquantized"),
    (dict(quant_dtype="fp8"), "fp8-tensor"),
    (dict(quant_dtype="fp8", static_activation_scale=True), "fp8-tensor-static"),
    (dict(quant_dtype="fp8", per_token_quantized_activations=True, per_channel_quantized_weights=True), "fp8-token"),
    (dict(quant_dtype="fp8", block_shape=(128, 128)), "fp8-block128x128"),
]


@pytest.mark.parametrize("flags,name", FLAG_CASES)
def test_from_flags(flags, name):
    assert QuantConfig.from_flags(**flags).name == name


@pytest.mark.parametrize("flags,text", [
    (dict(quant_dtype="int4"), "--quant-dtype ('int4') must be one of ['none', 'fp8']"),
    (dict(quant_dtype="fp8", per_token_quantized_activations=True), "go together"),
    (dict(quant_dtype=None, block_shape=(128, 128)), "--quant-dtype (none) does not take"),
])
def test_from_flags_errors(flags, text):
    with pytest.raises(ValueError) as info:
        QuantConfig.from_flags(**flags)
    assert text in str(info.value)


def test_quant_params_require_scales():
    with pytest.raises(ValueError, match="w1_scale/w2_scale are required for scheme fp8-token"):
        MoEQuantParams(QuantConfig.fp8_per_token())
    with pytest.raises(ValueError, match="a1_scale/a2_scale are required"):
        MoEQuantParams(QuantConfig.fp8_per_tensor(static=True), torch.ones(1), torch.ones(1))
