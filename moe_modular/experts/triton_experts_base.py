"""TritonExpertsBase: what the two Triton experts (standard and batched format) share."""
from __future__ import annotations

from typing import Optional

from moe_modular.config import MoEConfig
from moe_modular.experts.triton_common import triton_supports
from moe_modular.experts.triton_plan import TileSelector, scheme_modes
from moe_modular.kernels.host import BoundedCache
from moe_modular.interfaces import FusedMoEExpertsModular
from moe_modular.quant import MoEQuantParams


class TritonExpertsBase(FusedMoEExpertsModular):
    """Construction (scheme modes, tile selection, the activation-fusion switch, the workspace layout
    memo), support checks and expert-map support of the Triton experts; each subclass gives its
    activation format, chunking and apply.

    Extra keywords: tile_table (a TileConfigTable; the packaged tables when None) or tile_config
    (fixed tiles for every call, e.g. in tests); fuse_activation (default True: SiLU / GELU run in
    the first GEMM's epilogue where the scheme and tiles allow; False keeps the separate kernel).
    """

    def __init__(self, moe: MoEConfig, quant: MoEQuantParams, max_num_tokens: Optional[int] = None,
                 num_dispatchers: int = 1, *, tile_table=None, tile_config=None,
                 fuse_activation: bool = True) -> None:
        super().__init__(moe, quant, max_num_tokens=max_num_tokens, num_dispatchers=num_dispatchers)
        self.modes = scheme_modes(moe.quant)
        self.tiles = TileSelector(moe, tile_table, tile_config)
        self.fuse_activation = fuse_activation
        self._layouts = BoundedCache()

    @classmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        return triton_supports(moe)

    def supports_expert_map(self) -> bool:
        return True
