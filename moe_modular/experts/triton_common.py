"""What TritonExperts and BatchedTritonExperts share: capability checks, the per-scheme scale
modes of the two GEMMs, tile selection and carving typed buffers out of one workspace.

Shape legend: R rows of the intermediate (routes T*k, or El*Bt batched slots), N2 = w1 rows
(2 * intermediate), N intermediate, K hidden, El local experts, G groups of the intermediate.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import Optional

import torch

from moe_modular.config import SUPPORTED_DTYPES, Activation, MoEConfig
from moe_modular.kernels.host import BoundedCache
from moe_modular.quant import ActivationQuant, QuantConfig, WeightQuant

try:
    import triton  # noqa: F401  (availability check)

    from moe_modular.kernels.act_and_mul import IntermediateQuant
    from moe_modular.kernels.moe_gemm import AScale, BScale, GemmTile, _moe_gemm_kernel
    from moe_modular.tile_config import TileConfig, TileConfigTable, device_name
    TRITON_IMPORT_ERROR: Optional[str] = None
except ImportError as exc:  # supports() reports it; nothing else runs without triton
    TRITON_IMPORT_ERROR = f"triton is not installed ({exc})"

# Workspace slices start at multiples of this many bytes (any dtype view is aligned).
_ALIGN_BYTES = 256
# fp8 tensor-core MMAs take K steps of 32: the smallest K tile (and so activation group) of an fp8 GEMM.
FP8_MIN_BLOCK_K = 32
# The alignment block can be any power of two up to this (workspaces are sized for all of them).
MAX_BLOCK_M = 256


@dataclass(frozen=True)
class SchemeModes:
    """How one quant scheme maps onto the kernels' scale modes."""

    a1: "AScale"  # the first GEMM's activation scale
    w: "BScale"  # both GEMMs' weight scales
    intermediate: "IntermediateQuant"  # how act_and_mul writes the intermediate
    a2: "AScale"  # the second GEMM's activation scale


def scheme_modes(q: QuantConfig) -> SchemeModes:
    if not q.is_quantized:
        return SchemeModes(AScale.NONE, BScale.NONE, IntermediateQuant.NONE, AScale.NONE)
    by_scheme = {
        (ActivationQuant.PER_TENSOR, WeightQuant.PER_TENSOR, True):
            SchemeModes(AScale.TENSOR, BScale.TENSOR, IntermediateQuant.TENSOR_STATIC, AScale.TENSOR),
        (ActivationQuant.PER_TENSOR, WeightQuant.PER_TENSOR, False):
            SchemeModes(AScale.TENSOR, BScale.TENSOR, IntermediateQuant.TENSOR_DYNAMIC, AScale.EXPERT),
        (ActivationQuant.PER_TOKEN, WeightQuant.PER_CHANNEL, False):
            SchemeModes(AScale.ROW, BScale.CHANNEL, IntermediateQuant.TOKEN, AScale.ROW),
        (ActivationQuant.GROUP, WeightQuant.BLOCK, False):
            SchemeModes(AScale.GROUP, BScale.BLOCK, IntermediateQuant.GROUP, AScale.GROUP),
    }
    return by_scheme[(q.activation, q.weight, q.static_activation_scale)]


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


class TileSelector:
    """Per-instance tile choice: tuned tables, else the default heuristic; memoized per problem."""

    def __init__(self, moe: MoEConfig, table: Optional["TileConfigTable"] = None,
                 fixed: Optional["TileConfig"] = None) -> None:
        self.moe = moe
        self.table = table
        self.fixed = fixed
        self._devices: dict[torch.device, str] = {}
        self._chosen = BoundedCache()
        self._fused = BoundedCache()

    def fused_gemm1(self, tile: "GemmTile") -> "GemmTile":
        """fused_gemm1_tile(tile), memoized (the forward asks for it on every call)."""
        return self._fused.get_or_make(tile, lambda: fused_gemm1_tile(tile))

    def __call__(self, M: int, El: int, N: int, K: int, topk: int, device: torch.device) -> "TileConfig":
        if self.fixed is not None:
            return self.fixed
        name = self._devices.get(device)
        if name is None:
            name = self._devices[device] = device_name(device)
        if self.table is None:
            self.table = TileConfigTable.load()
        return self._chosen.get_or_make(
            (M, El, N, K, topk, name),
            lambda: self.table.select(M, El, N, K, topk, self.moe.dtype, self.moe.quant, name))


class WorkspaceLayout:
    """Named typed regions laid out back to back (each aligned) in one flat workspace.

    `add(name, shape, dtype)` reserves a region; `numel(ws_dtype)` is the workspace size in
    elements of ws_dtype; `carve(ws)` returns {name: view} over a workspace of that size.
    """

    def __init__(self) -> None:
        self._regions: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []
        self._bytes = 0
        # carve's views of the last workspaces, by (address, bytes): the views hold their storage, so no other
        # tensor can have the same address while an entry lives
        self._carved = BoundedCache(limit=4)

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> "WorkspaceLayout":
        n = 1
        for s in shape:
            n *= int(s)
        self._regions.append((name, tuple(int(s) for s in shape), dtype, self._bytes))
        size = n * dtype.itemsize
        self._bytes += -(-size // _ALIGN_BYTES) * _ALIGN_BYTES
        return self

    def numel(self, ws_dtype: torch.dtype) -> int:
        item = ws_dtype.itemsize
        return max(1, -(-self._bytes // item))

    def carve(self, ws: torch.Tensor) -> dict[str, torch.Tensor]:
        """{name: view} over ws (the same view objects for the same memory: carve runs on every forward)."""
        key = (ws.data_ptr(), ws.numel() * ws.element_size(), ws.device)
        return self._carved.get_or_make(key, lambda: self._carve(ws))

    def _carve(self, ws: torch.Tensor) -> dict[str, torch.Tensor]:
        flat = ws.reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        if nbytes < self._bytes:
            raise ValueError(f"workspace holds {nbytes} bytes, the layout needs {self._bytes}")
        raw = flat.view(torch.uint8)
        out = {}
        for name, shape, dtype, off in self._regions:
            item = dtype.itemsize
            n = 1
            for s in shape:
                n *= s
            out[name] = raw[off: off + n * item].view(dtype).view(shape)
        return out


def current_device() -> torch.device:
    """The device workspace_shapes plans tiles for (it is not given one): the current CUDA device, else
    the CPU (Triton's interpreter)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fuses_activation(enabled: bool, q: QuantConfig, activation: Activation, gemm1: Optional["GemmTile"] = None) -> bool:
    """Whether the first GEMM applies the activation in its epilogue: unquantized SiLU / GELU, and fp8
    block SiLU / GELU where the first GEMM's tile (gemm1, standard format) says act_q: it then also
    quantizes the intermediate in 1 x group groups. Other fp8 schemes need scales over more than a
    tile (a row, an expert): act_and_mul does it."""
    from moe_modular.kernels.act_and_mul import GEMM_FUSABLE_ACTIVATIONS

    if not enabled or activation not in GEMM_FUSABLE_ACTIVATIONS:
        return False
    if gemm1 is not None and gemm1.act_q and not q.is_block:
        raise ValueError(f"tile act_q (1) is for the fp8 block scheme; the scheme is {q.name}")
    return not q.is_quantized or (gemm1 is not None and bool(gemm1.act_q))


def fused_gemm1_tile(tile: "GemmTile") -> "GemmTile":
    """The tables' BLOCK_N counts w1 rows; fused, each program reads BLOCK_N gate + BLOCK_N up rows,
    so the same w1 rows per program is half the output columns."""
    return replace(tile, BLOCK_N=max(16, tile.BLOCK_N // 2))


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


def h1_dtype(moe: MoEConfig) -> torch.dtype:
    """The first GEMM's output dtype: float32 before an fp8 re-quantization (rounding it to 16 bits
    first would move values across fp8 rounding boundaries), else the activation dtype."""
    return torch.float32 if moe.quant.is_quantized else moe.dtype


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


def bytes_to_numel(nbytes: int, dtype: torch.dtype) -> int:
    item = dtype.itemsize
    return max(1, -(-int(nbytes) // item))


def intermediate_regions(layout: WorkspaceLayout, R: int, N: int, El: int, moe: MoEConfig) -> WorkspaceLayout:
    """The intermediate (R, N) and its scales, as the scheme needs them."""
    q = moe.quant
    modes = scheme_modes(q)
    layout.add("intermediate", (R, N), torch.float8_e4m3fn if q.is_quantized else moe.dtype)
    if modes.intermediate is IntermediateQuant.TOKEN:
        layout.add("intermediate_scale", (R, 1), torch.float32)
    elif modes.intermediate is IntermediateQuant.GROUP:
        layout.add("intermediate_scale", (R, -(-N // q.block_shape[1])), torch.float32)
    elif modes.intermediate is IntermediateQuant.TENSOR_DYNAMIC:
        layout.add("intermediate_scale", (El,), torch.float32)
        layout.add("amax", (El,), torch.float32)
    return layout
