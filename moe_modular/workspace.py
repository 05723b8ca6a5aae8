"""WorkspaceCache: grow-only scratch buffers shared by the modular kernels that hold the same cache.

One cache is created by whoever owns the layers (a model, a test) and passed to every
FusedMoEModularKernel that should share buffers; nothing is process-global. Defined in all2all.buffers
(the all-to-all handles use it too, and all2all imports nothing from moe_modular).
"""
from all2all.buffers import GROW_ALIGN, GROWTH, WorkspaceCache

__all__ = ["GROWTH", "GROW_ALIGN", "WorkspaceCache"]
