"""What TritonExperts and BatchedTritonExperts share at run time: the capability check, the device check and the
views over workspaces (their planning is in triton_plan.py).

Shape legend: R rows of the intermediate (routes T*k, or El*Bt batched slots), N2 = w1 rows (2 * intermediate),
K hidden, El local experts.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from moe_modular.config import SUPPORTED_DTYPES, Activation, MoEConfig
from moe_modular.experts.triton_plan import h1_dtype

try:
    import triton  # noqa: F401  (availability check)

    from moe_modular.kernels.moe_gemm import _moe_gemm_kernel
    TRITON_IMPORT_ERROR: Optional[str] = None
except ImportError as exc:  # supports() reports it; nothing else runs without triton
    TRITON_IMPORT_ERROR = f"triton is not installed ({exc})"

# fp8 tensor-core MMAs take K steps of 32: the smallest K tile (and so activation group) of an fp8 GEMM.
FP8_MIN_BLOCK_K = 32


def triton_supports(moe: MoEConfig) -> tuple[bool, str]:
    """(ok, reason) for the Triton experts: triton present, dtype, scheme, activation, device."""
    if TRITON_IMPORT_ERROR is not None or importlib.util.find_spec("triton") is None:
        return False, TRITON_IMPORT_ERROR or "triton is not installed"
    if moe.dtype not in SUPPORTED_DTYPES.values():
        return False, f"dtype {moe.dtype} is not one of {list(SUPPORTED_DTYPES)}"
    q = moe.quant
    if q.is_block:
        bn, bk = q.block_shape
        if bk < FP8_MIN_BLOCK_K or bk & (bk - 1):
            return False, (f"block_shape[1] ({bk}) must be a power of two >= {FP8_MIN_BLOCK_K} (K tiles may not straddle "
                           f"a group, and an fp8 MMA on a GPU takes K steps of {FP8_MIN_BLOCK_K})")
    if not isinstance(moe.activation, Activation):
        return False, f"activation {moe.activation!r} is not an Activation"
    if q.is_quantized and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            return False, f"fp8 GEMMs need compute capability >= 8.9, the GPU has {major}.{minor}"
    return True, ""


def check_device(t: torch.Tensor) -> None:
    """CPU tensors need the kernels to have been built by Triton's interpreter."""
    if t.device.type == "cuda":
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(_moe_gemm_kernel, InterpretedFunction):
        raise RuntimeError(
            f"Triton experts got {t.device.type} tensors; run on CUDA, or set TRITON_INTERPRET=1 before "
            "triton is imported to run the kernels through Triton's interpreter")


def current_device() -> torch.device:
    """The device workspace_shapes plans tiles for (it is not given one): the current CUDA device, else
    the CPU (Triton's interpreter)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def h1_view(workspace13: torch.Tensor, shape: tuple[int, ...], moe: MoEConfig, sized_fused: bool,
            activation: Activation) -> torch.Tensor:
    """The first GEMM's output h1 over workspace13, which holds none when workspace_shapes sized it
    for the fused first GEMM of moe.activation (sized_fused) and this call's activation is not fused."""
    if sized_fused:
        raise ValueError(
            f"activation ({activation.value}) cannot run in the first GEMM's epilogue, and the workspaces were "
            f"sized for MoEConfig.activation ({moe.activation.value}), which does; build the experts with "
            f"activation={activation.value} or fuse_activation=False")
    return overlapping_view(workspace13, shape, h1_dtype(moe))


def overlapping_view(ws: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A (shape, dtype) view over the start of workspace ws (regions that reuse the same memory)."""
    raw = ws.reshape(-1).view(torch.uint8)
    n = 1
    for s in shape:
        n *= int(s)
    nbytes = n * dtype.itemsize
    if raw.numel() < nbytes:
        raise ValueError(f"workspace holds {raw.numel()} bytes, a {tuple(shape)} {dtype} view needs {nbytes}")
    return raw[:nbytes].view(dtype).view(shape)
