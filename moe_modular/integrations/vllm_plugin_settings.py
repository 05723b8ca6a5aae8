"""VllmPluginSettings: the vLLM plugin's switches, read from the environment once at plugin load."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

ENV_ENABLE = "MOE_MODULAR_ENABLE"
ENV_ALL2ALL_BACKEND = "MOE_MODULAR_ALL2ALL_BACKEND"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class VllmPluginSettings:
    """enabled: route vLLM's unquantized fused-MoE layers through moe-modular (MOE_MODULAR_ENABLE).
    all2all_backend: the moe-modular all2all backend for expert-parallel layers that dispatch
      (MOE_MODULAR_ALL2ALL_BACKEND); None maps vLLM's --all2all-backend name instead.
    """

    enabled: bool = False
    all2all_backend: Optional[str] = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "VllmPluginSettings":
        raw = environ.get(ENV_ENABLE, "").strip().lower()
        if raw in _TRUE:
            enabled = True
        elif raw in _FALSE:
            enabled = False
        else:
            raise ValueError(
                f"{ENV_ENABLE} ({environ.get(ENV_ENABLE)!r}) must be one of {list(_TRUE + _FALSE[1:])} or unset"
            )
        backend = environ.get(ENV_ALL2ALL_BACKEND, "").strip() or None
        return cls(enabled=enabled, all2all_backend=backend)
