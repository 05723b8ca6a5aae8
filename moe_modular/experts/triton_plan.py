"""Host-side planning of the Triton experts (TritonExperts, BatchedTritonExperts): the scheme's scale modes, the
tiles (tables or heuristic), whether the first GEMM applies the activation, the sorted-row choices and the
workspace layouts. Everything here is decided per problem size on the host and memoized by the experts; apply
only launches. Importable without Triton.

Shape legend: M tokens (or Bt slots per expert, batched), k topk, R = M * k routes (or El * Bt slots),
S sorted capacity, K hidden, N intermediate, N2 = 2N w1 rows, El local experts.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from moe_modular.config import Activation, MoEConfig
from moe_modular.kernels.gemm_config import GEMM_FUSABLE_ACTIVATIONS, AScale, BScale, GemmTile, IntermediateQuant
from moe_modular.kernels.host import BoundedCache
from moe_modular.quant import ActivationQuant, QuantConfig, WeightQuant
from moe_modular.tile_config import TileConfig, TileConfigTable, device_name

# Workspace slices start at multiples of this many bytes (any dtype view is aligned).
_ALIGN_BYTES = 256
# The alignment block can be any power of two up to this (workspaces are sized for all of them).
MAX_BLOCK_M = 256


@dataclass(frozen=True)
class SchemeModes:
    """How one quant scheme maps onto the kernels' scale modes."""

    a1: AScale  # the first GEMM's activation scale
    w: BScale  # both GEMMs' weight scales
    intermediate: IntermediateQuant  # how the intermediate is written
    a2: AScale  # the second GEMM's activation scale


_SCHEME_MODES = {
    (ActivationQuant.PER_TENSOR, WeightQuant.PER_TENSOR, True):
        SchemeModes(AScale.TENSOR, BScale.TENSOR, IntermediateQuant.TENSOR_STATIC, AScale.TENSOR),
    (ActivationQuant.PER_TENSOR, WeightQuant.PER_TENSOR, False):
        SchemeModes(AScale.TENSOR, BScale.TENSOR, IntermediateQuant.TENSOR_DYNAMIC, AScale.EXPERT),
    (ActivationQuant.PER_TOKEN, WeightQuant.PER_CHANNEL, False):
        SchemeModes(AScale.ROW, BScale.CHANNEL, IntermediateQuant.TOKEN, AScale.ROW),
    (ActivationQuant.GROUP, WeightQuant.BLOCK, False):
        SchemeModes(AScale.GROUP, BScale.BLOCK, IntermediateQuant.GROUP, AScale.GROUP),
}
_UNQUANTIZED_MODES = SchemeModes(AScale.NONE, BScale.NONE, IntermediateQuant.NONE, AScale.NONE)


def scheme_modes(q: QuantConfig) -> SchemeModes:
    if not q.is_quantized:
        return _UNQUANTIZED_MODES
    return _SCHEME_MODES[(q.activation, q.weight, q.static_activation_scale)]


class TileSelector:
    """Per-instance tile choice: tuned tables, else the default heuristic; memoized per problem."""

    def __init__(self, moe: MoEConfig, table: Optional[TileConfigTable] = None,
                 fixed: Optional[TileConfig] = None) -> None:
        self.moe = moe
        self.table = table
        self.fixed = fixed
        self._devices: dict[torch.device, str] = {}
        self._chosen = BoundedCache()
        self._fused = BoundedCache()

    def fused_gemm1(self, tile: GemmTile) -> GemmTile:
        """fused_gemm1_tile(tile), memoized (the forward asks for it on every call)."""
        return self._fused.get_or_make(tile, lambda: fused_gemm1_tile(tile))

    def __call__(self, M: int, El: int, N: int, K: int, topk: int, device: torch.device) -> TileConfig:
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


def fuses_activation(enabled: bool, q: QuantConfig, activation: Activation, cfg: Optional[TileConfig] = None) -> bool:
    """Whether the first GEMM applies the activation in its epilogue: unquantized SiLU / GELU, and fp8 block SiLU /
    GELU where the tiles (cfg, standard format) say act_q: it then also quantizes the intermediate in 1 x group
    groups. Other fp8 schemes need scales over more than a tile (a row, an expert): act_and_mul does it."""
    if not enabled or activation not in GEMM_FUSABLE_ACTIVATIONS:
        return False
    if cfg is not None and cfg.act_q and not q.is_block:
        raise ValueError(f"tile act_q (1) is for the fp8 block scheme; the scheme is {q.name}")
    return not q.is_quantized or (cfg is not None and bool(cfg.act_q))


def fused_gemm1_tile(tile: GemmTile) -> GemmTile:
    """The tables' BLOCK_N counts w1 rows; fused, each program reads BLOCK_N gate + BLOCK_N up rows,
    so the same w1 rows per program is half the output columns."""
    return replace(tile, BLOCK_N=max(16, tile.BLOCK_N // 2))


def h1_dtype(moe: MoEConfig) -> torch.dtype:
    """The first GEMM's output dtype: float32 before an fp8 re-quantization (rounding it to 16 bits
    first would move values across fp8 rounding boundaries), else the activation dtype."""
    return torch.float32 if moe.quant.is_quantized else moe.dtype


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


def align_regions(layout: WorkspaceLayout, R: int, El: int) -> WorkspaceLayout:
    """moe_align's int32 buffers, sized for every BLOCK_M up to MAX_BLOCK_M."""
    from moe_modular.kernels.moe_align import align_workspace_numel

    sizes: dict[str, int] = {}
    bm = 16
    while bm <= MAX_BLOCK_M:
        for name, n in align_workspace_numel(R, El, bm).items():
            sizes[name] = max(sizes.get(name, 0), n)
        bm *= 2
    for name, n in sizes.items():
        layout.add(name, (n,), torch.int32)
    return layout


@dataclass(frozen=True)
class Sorting:
    """Sorted rows of the standard format: tokens gathered in sorted-route order for the first GEMM (sort_in), the
    intermediate kept in sorted order for the second (sort_mid), both blocks of block_m rows (0: route order)."""

    sort_in: bool = False
    sort_mid: bool = False
    block_m: int = 0

    @property
    def any(self) -> bool:
        return self.sort_in or self.sort_mid


ROUTE_ORDER = Sorting()


def sorting(fuse_enabled: bool, q: QuantConfig, cfg: TileConfig, activation: Activation) -> Sorting:
    """Sorted rows only where the first GEMM writes the intermediate itself (unquantized fused activation) and the
    tiles load A by descriptor."""
    if not fuses_activation(fuse_enabled, q, activation):  # unquantized only
        return ROUTE_ORDER
    sort_in, sort_mid = bool(cfg.launch1.a_tma), bool(cfg.launch2.a_tma)
    return Sorting(sort_in, sort_mid, cfg.block_m) if (sort_in or sort_mid) else ROUTE_ORDER


def standard_layout(moe: MoEConfig, M: int, N2: int, K: int, topk: int, El: int, order: Sorting,
                    fused: bool) -> tuple[int, WorkspaceLayout]:
    """(workspace13 elements, workspace2's regions) of the standard format: workspace13 holds h1 (R, N2) (none when
    fused), the sorted tokens (S, K) (sort_in), then y (R, K); workspace2 the intermediate ((R, N), or (S, N)
    sort_mid), its scales and moe_align's buffers."""
    from moe_modular.kernels.moe_align import sorted_capacity

    R = M * topk
    S = sorted_capacity(R, El, order.block_m) if order.any else 0
    item = moe.dtype.itemsize
    h1_bytes = 0 if fused else R * N2 * h1_dtype(moe).itemsize
    ws13_numel = bytes_to_numel(max(h1_bytes, R * K * item, S * K * item if order.sort_in else 0), moe.dtype)
    ws2 = intermediate_regions(WorkspaceLayout(), S if order.sort_mid else R, N2 // 2, El, moe)
    return ws13_numel, align_regions(ws2, R, El)


@dataclass(frozen=True)
class StandardPlan:
    """What TritonExperts decides on the host for one problem size and activation."""

    cfg: TileConfig
    order: Sorting
    fused: bool  # this activation runs in the first GEMM's epilogue
    sized_fused: bool  # the workspaces are sized for MoEConfig.activation fused (no h1)
    gemm1: GemmTile  # the first GEMM's tile as launched (fused: fused_gemm1_tile)
    ws13_numel: int
    layout: WorkspaceLayout  # workspace2's regions
    unsorted_layout: WorkspaceLayout  # the same in route order (workspaces sized for other tiles)


def batched_layout(moe: MoEConfig, fused: bool, B: int, N2: int, El: int) -> tuple[int, WorkspaceLayout]:
    """(workspace13 elements, workspace2's regions) of the batched format: workspace13 holds h1 (El, Bt, N2) (none
    when fused), workspace2 the intermediate and its scales."""
    rows = El * B
    h1_bytes = 0 if fused else rows * N2 * h1_dtype(moe).itemsize
    return bytes_to_numel(h1_bytes, moe.dtype), intermediate_regions(WorkspaceLayout(), rows, N2 // 2, El, moe)
