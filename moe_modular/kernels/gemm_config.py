"""What one grouped expert GEMM (moe_gemm) is given besides its operands, as immutable values:

- the tile (GemmTile) and how it is launched (LaunchOptions);
- the row layout: SortedRows (moe_align's blocks), RouteRows (a block per route, one token) or BatchedRows
  (slots per expert);
- the scales (GemmScales) and the epilogue (GemmEpilogue);
- how the intermediate between the two GEMMs is quantized (IntermediateQuant).

Shape legend (moe_gemm.py): R routes (T * k), T tokens, k topk, El local experts, S sorted-id capacity,
Mb blocks of BLOCK_M rows, Ko reduction size, No output columns. Importable without Triton.

The tile and launch options are frozen dataclasses (configuration, chosen once per problem size). The row layout,
scales and epilogue hold the forward's tensors and are built on every forward, so they are NamedTuples (a third of
a frozen dataclass's construction time on the host); moe_gemm validates them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch

from moe_modular.config import Activation


class IntermediateQuant(enum.Enum):
    """How the intermediate between the two GEMMs is written (by act_and_mul, or the first GEMM's epilogue)."""

    NONE = "none"  # in the output tensor's dtype
    TENSOR_STATIC = "tensor-static"  # fp8 with a given (1,) scale
    TENSOR_DYNAMIC = "tensor-dynamic"  # fp8, one scale per local expert from that expert's amax
    TOKEN = "token"  # fp8, one scale per row
    GROUP = "group"  # fp8, one scale per row and group of columns


class AScale(enum.Enum):
    """Layout of the A (activation) scale."""

    NONE = 0
    TENSOR = 1  # (1,)
    EXPERT = 2  # (El,), one per local expert
    ROW = 3  # one per A row
    GROUP = 4  # one per A row and group of group_k columns


class BScale(enum.Enum):
    """Layout of the B (weight) scale."""

    NONE = 0
    TENSOR = 1  # (El,)
    CHANNEL = 2  # (El, No, 1)
    BLOCK = 3  # (El, ceil(No / group_n), ceil(Ko / group_k))


@dataclass(frozen=True)
class GemmTile:
    """The tile of one grouped GEMM: output block, K step, program order, warps and pipeline stages."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 1
    num_warps: int = 4
    num_stages: int = 3


# LaunchOptions.persistent: 0 a program per tile, 1 a program per SM walking the tiles, 2 that with the loop nest
# flattened (the next tile's loads overlap this tile's epilogue).
PERSISTENT_MODES = (0, 1, 2)


@dataclass(frozen=True)
class LaunchOptions:
    """How a tile is loaded and scheduled; every option leaves the values as they are.

    b_tma: 1 loads B tiles through a tensor descriptor (TMA on Hopper) instead of pointers.
    a_tma: 1 loads A tiles so too, where A's rows are contiguous per block (sorted A, batched format).
    persistent (sorted rows only): PERSISTENT_MODES.
    pdl: 1 (a GPU of compute capability >= 9) launches the GEMM as a programmatic dependent of the kernel before
      it: its programs are placed while that one finishes and wait for its end before they read anything.
    ws: 1 runs the warp-specialized Gluon kernel (moe_gemm_ws.py, moe_gemm_ws_fp8.py) where it covers the launch.
    """

    b_tma: int = 0
    a_tma: int = 0
    persistent: int = 0
    pdl: int = 0
    ws: int = 0

    def __post_init__(self) -> None:
        for name in ("b_tma", "a_tma", "pdl", "ws"):
            if getattr(self, name) not in (0, 1):
                raise ValueError(f"LaunchOptions.{name} ({getattr(self, name)!r}) must be 0 or 1")
        if self.persistent not in PERSISTENT_MODES:
            raise ValueError(f"LaunchOptions.persistent ({self.persistent!r}) must be one of {PERSISTENT_MODES}")


DEFAULT_LAUNCH = LaunchOptions()


class SortedRows(NamedTuple):
    """Rows from moe_align (the standard format): block b of BLOCK_M entries of sorted_ids_S belongs to local
    expert block_expert_Mb[b]; entry s < num_routes reads A row s // a_row_div and writes C row s; s ==
    num_routes pads. a_row_div is k where A holds tokens (a first GEMM), 1 where it holds routes.
    a_sorted / c_sorted: the entry at position p reads A row p / writes C row p instead (a block's rows are then
    contiguous; A or C has sorted_ids_S.numel() rows, a per-row A scale is in the same order)."""

    sorted_ids_S: torch.Tensor
    block_expert_Mb: torch.Tensor
    num_post_padded: torch.Tensor
    num_routes: int
    a_row_div: int = 1
    a_sorted: bool = False
    c_sorted: bool = False


class RouteRows(NamedTuple):
    """A block per route (route r alone, its first row), its expert topk_ids_Tk[r // k, r % k]: local ids, or global
    ids mapped by expert_map_E (not held: nothing written). No alignment; meant for a single token, whose k routes
    go to k distinct experts. Rows in route order; A row r // a_row_div."""

    topk_ids_Tk: torch.Tensor
    num_routes: int
    a_row_div: int = 1
    expert_map_E: Optional[torch.Tensor] = None


class BatchedRows(NamedTuple):
    """The batched format: A (El, Bt, Ko), C (El, Bt, No); expert e computes its first expert_num_tokens_El[e] rows."""

    expert_num_tokens_El: torch.Tensor


RowLayout = Union[SortedRows, RouteRows, BatchedRows]
ROW_LAYOUTS = (SortedRows, RouteRows, BatchedRows)


class GemmScales(NamedTuple):
    """Float32 scales, multiplied to dequantize (moe_gemm.py's docstring gives the layouts); group_shape =
    (group_n, group_k) for block weight scales. A tensor is given exactly where its mode is not NONE."""

    a: Optional[torch.Tensor] = None
    a_mode: AScale = AScale.NONE
    b: Optional[torch.Tensor] = None
    b_mode: BScale = BScale.NONE
    group_shape: tuple[int, int] = (1, 1)

    @property
    def scaled(self) -> bool:
        return self.a_mode is not AScale.NONE or self.b_mode is not BScale.NONE


NO_SCALES = GemmScales()


class GemmEpilogue(NamedTuple):
    """What the GEMM does to its float32 tile before it stores it.

    activation (SiLU or GELU; unquantized, or fp8 group activations with block weights): B holds the gate rows
      then the up rows (El, 2 * No, Ko) and C gets act(a @ gate.T) * (a @ up.T), (rows, No); the tile's BLOCK_N
      counts C's columns.
    topk_weights_Tk (T, k) float32: C row s is multiplied by weight[s // k, s % k].
    c_group (with an activation and fp8 C): C is quantized in 1 x c_group groups, c_scale (rows, ceil(No / c_group))
      float32 gets the scales.
    """

    activation: Optional[Activation] = None
    topk_weights_Tk: Optional[torch.Tensor] = None
    c_scale: Optional[torch.Tensor] = None
    c_group: int = 0


PLAIN_EPILOGUE = GemmEpilogue()
# Activations the first GEMM can apply in its epilogue (gate and up are contiguous halves of w1).
GEMM_FUSABLE_ACTIVATIONS = (Activation.SILU, Activation.GELU)
