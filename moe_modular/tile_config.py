"""Tile configurations of the Triton expert GEMMs: tuned tables plus a default heuristic.

A table (one YAML file in moe_modular/configs/) is keyed by the problem (E, N, K, activation
dtype, quant scheme name, device name) and maps token-count buckets M to one TileConfig:

    E: 128
    N: 768                 # intermediate size (w1 is (E, 2N, K))
    K: 2048                # hidden size
    dtype: bfloat16
    quant: unquantized     # QuantConfig.name
    device: NVIDIA_H200    # torch.cuda.get_device_name() with spaces as underscores
    tiles:
      1: {BLOCK_M: 16, BLOCK_N: 64, BLOCK_K: 128, GROUP_M: 1, num_warps: 4, num_stages: 4}
      64: {BLOCK_M: 32, BLOCK_N: 128, BLOCK_K: 64, GROUP_M: 1, num_warps: 4, num_stages: 4,
           gemm2: {BLOCK_N: 64}}   # optional overrides for the second GEMM (not BLOCK_M)
      4096: {BLOCK_M: 128, BLOCK_N: 256, BLOCK_K: 64, GROUP_M: 8, num_warps: 8, num_stages: 3,
             b_tma: 1,             # optional: weight tiles through a tensor descriptor (TMA)
             gemm2: {a_tma: 1,     # optional: activation tiles too, where their rows are contiguous
                     persistent: 2}}  # optional: a program per SM walking the tiles (2: loop nest flattened)
      # pdl: 1: the GEMM launched as a programmatic dependent (Hopper and later): placed while the kernel
      # before finishes, it waits for that one's end; under gemm2 the top-k sum after it launches so too
      # ws: 1: the warp-specialized Hopper kernel (moe_gemm_ws.py) where it covers the launch (A sorted with
      # a_tma: 1, or gathered by the kernel)

For M between buckets the nearest bucket in log2(M) is used. Without a matching table,
`default_tile_config` picks tiles from the average tokens per expert.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import torch

from moe_modular.config import dtype_name
from moe_modular.kernels.moe_gemm import PERSISTENT_MODES, GemmTile
from moe_modular.quant import QuantConfig

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
CPU_DEVICE_NAME = "cpu"
_TILE_FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "b_tma", "a_tma", "act_q",
                "persistent", "ws", "pdl")
_FLAG_FIELDS = ("b_tma", "a_tma", "act_q", "ws", "pdl")  # 0 / 1, listed in tables only where 1
_OFF_BY_DEFAULT = _FLAG_FIELDS + ("persistent",)  # 0 = off; listed in tables only where set
# Table names (device_name) of Hopper-class GPUs: there the default heuristic's compute-bound tiles are the ones
# the tuned tables chose on the H100 and H200, the warp-specialized kernels included.
HOPPER_DEVICE_PREFIXES = ("NVIDIA_H100", "NVIDIA_H200", "NVIDIA_H800", "NVIDIA_H20", "NVIDIA_GH200")


def device_name(device: torch.device) -> str:
    """The table key of a device: the CUDA device name with spaces as underscores, or "cpu"."""
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_DEVICE_NAME
    return torch.cuda.get_device_name(device).strip().replace(" ", "_")


@dataclass(frozen=True)
class TileKey:
    """What a table is tuned for."""

    E: int
    N: int
    K: int
    dtype: str
    quant: str
    device: str


@dataclass(frozen=True)
class TileConfig:
    """Tiles of both grouped GEMMs of one forward; they share BLOCK_M (the alignment block)."""

    gemm1: GemmTile
    gemm2: GemmTile

    def __post_init__(self) -> None:
        if self.gemm1.BLOCK_M != self.gemm2.BLOCK_M:
            raise ValueError(
                f"TileConfig BLOCK_M must match for both GEMMs, got {self.gemm1.BLOCK_M} and {self.gemm2.BLOCK_M}")
        for name, tile in (("gemm1", self.gemm1), ("gemm2", self.gemm2)):
            for f in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
                v = getattr(tile, f)
                if not isinstance(v, int) or v < 1 or v & (v - 1):
                    raise ValueError(f"TileConfig.{name}.{f} ({v!r}) must be a power of two")
            for f in ("GROUP_M", "num_warps", "num_stages"):
                v = getattr(tile, f)
                if not isinstance(v, int) or v < 1:
                    raise ValueError(f"TileConfig.{name}.{f} ({v!r}) must be an int >= 1")
            for f in _FLAG_FIELDS:
                if getattr(tile, f) not in (0, 1):
                    raise ValueError(f"TileConfig.{name}.{f} ({getattr(tile, f)!r}) must be 0 or 1")
            if tile.persistent not in PERSISTENT_MODES:
                raise ValueError(f"TileConfig.{name}.persistent ({tile.persistent!r}) must be one of {PERSISTENT_MODES}")

    @property
    def block_m(self) -> int:
        return self.gemm1.BLOCK_M

    @classmethod
    def from_dict(cls, d: dict) -> "TileConfig":
        unknown = set(d) - set(_TILE_FIELDS) - {"gemm2"}
        if unknown:
            raise ValueError(f"tile entry has unknown fields {sorted(unknown)}; allowed: {list(_TILE_FIELDS)} + gemm2")
        base = GemmTile(**{f: int(d[f]) for f in _TILE_FIELDS if f in d})
        over = dict(d.get("gemm2") or {})
        if "BLOCK_M" in over:
            raise ValueError("tile entry gemm2 may not override BLOCK_M (both GEMMs share the alignment block)")
        bad = set(over) - set(_TILE_FIELDS)
        if bad:
            raise ValueError(f"tile entry gemm2 has unknown fields {sorted(bad)}; allowed: {list(_TILE_FIELDS[1:])}")
        return cls(base, replace(base, **{k: int(v) for k, v in over.items()}))

    def to_dict(self) -> dict:
        d = asdict(self.gemm1)
        over = {k: v for k, v in asdict(self.gemm2).items() if d[k] != v}
        for f in _OFF_BY_DEFAULT:  # 0 is the default; tables list these only where set
            if not d[f]:
                del d[f]
        if over:
            d["gemm2"] = over
        return d

    def with_block_k_limit(self, limit: int) -> "TileConfig":
        """The same tiles with BLOCK_K capped at `limit` (a group size the K tiles must not straddle)."""
        return TileConfig(replace(self.gemm1, BLOCK_K=min(self.gemm1.BLOCK_K, limit)),
                          replace(self.gemm2, BLOCK_K=min(self.gemm2.BLOCK_K, limit)))


def _pow2_at_most(x: int, cap: int, floor: int = 16) -> int:
    return max(floor, min(cap, 1 << max(0, (int(x) - 1).bit_length())))


def default_tile_config(M: int, E: int, N: int, K: int, topk: int, dtype: torch.dtype, quant: QuantConfig,
                        device: str) -> TileConfig:
    """Heuristic tiles from the average tokens per expert, M * topk / E (E local experts).

    Small batches stream weights (narrow BLOCK_M, deep BLOCK_K, many column tiles); large ones
    are compute-bound (128-row tiles, grouped ordering for L2 reuse; on Hopper the warp-specialized
    tiles of hopper_compute_tile). Under the CPU interpreter the fewest, largest tiles run fastest.
    """
    fp8 = quant.is_quantized
    if device == CPU_DEVICE_NAME:
        bm = _pow2_at_most(max(M * topk // max(E, 1), 1), 32)
        t1 = GemmTile(bm, _pow2_at_most(2 * N, 128), _pow2_at_most(K, 128), 1, 4, 1)
        t2 = GemmTile(bm, _pow2_at_most(K, 128), _pow2_at_most(N, 128), 1, 4, 1)
        cfg = TileConfig(t1, t2)
    else:
        per_expert = M * topk / max(E, 1)
        bk = 128 if fp8 else (32 if dtype == torch.float32 else 64)
        wide = fp8 or dtype == torch.float32  # 1-byte or 4-byte elements: keep BLOCK_K at bk
        if per_expert <= 2:  # weight streaming: deep K tiles, many column tiles
            base = GemmTile(16, 64, bk if wide else 4 * bk, 1, 4, 3)
        elif per_expert <= 12:
            base = GemmTile(16, 128, bk if wide else 2 * bk, 1, 4, 3)
        elif per_expert <= 96:
            base = GemmTile(64, 128, bk, 8, 4, 4)
        else:  # compute-bound: the widest tiles that fit shared memory
            hopper = hopper_compute_tile(dtype, quant, device)
            if hopper is not None:
                return hopper
            base = GemmTile(128, 256 if not fp8 else 128, bk, 8, 8, 3)
        if dtype == torch.float32:
            base = replace(base, num_stages=min(base.num_stages, 3))
        cfg = TileConfig(base, base)
    if quant.is_block:
        cfg = cfg.with_block_k_limit(quant.block_shape[1])
    return cfg


def hopper_compute_tile(dtype: torch.dtype, quant: QuantConfig, device: str) -> Optional[TileConfig]:
    """The compute-bound tiles the H100 and H200 tables chose (M * topk / E above 96) for 16-bit activations
    unquantized, fp8 per-token and fp8 128 x 128 blocks, on a Hopper-class device; None elsewhere. Where the
    warp-specialized kernel does not cover a launch (another Triton release, a non-standard format), the same
    tile runs in the tl.dot kernel."""
    if not device.startswith(HOPPER_DEVICE_PREFIXES) or dtype not in (torch.bfloat16, torch.float16):
        return None
    if not quant.is_quantized:
        tile = GemmTile(128, 256, 64, 8, 8, 4, a_tma=1, ws=1)
        return TileConfig(tile, tile)
    if quant == QuantConfig.fp8_block((128, 128)):
        gemm1 = GemmTile(128, 256, 128, 8, 8, 3, act_q=1, ws=1)
        return TileConfig(gemm1, replace(gemm1, BLOCK_N=128))
    if quant == QuantConfig.fp8_per_token():
        tile = GemmTile(128, 128, 128, 8, 8, 3, ws=1)
        return TileConfig(tile, tile)
    return None


@dataclass(frozen=True)
class TileConfigTable:
    """Tuned tables: {TileKey: {M bucket: TileConfig}}. Load with `TileConfigTable.load()`."""

    tables: dict = field(default_factory=dict)

    @classmethod
    def load(cls, directory: str = CONFIG_DIR) -> "TileConfigTable":
        """Read every *.yaml table in `directory` (an empty table when it has none)."""
        tables: dict[TileKey, dict[int, TileConfig]] = {}
        if not os.path.isdir(directory):
            return cls(tables)
        names = sorted(n for n in os.listdir(directory) if n.endswith(".yaml"))
        if not names:
            return cls(tables)
        import yaml  # only needed when there are tables to read

        for name in names:
            path = os.path.join(directory, name)
            with open(path) as f:
                doc = yaml.safe_load(f)
            key, buckets = cls.parse(doc, path)
            tables[key] = buckets
        return cls(tables)

    @staticmethod
    def parse(doc: dict, source: str = "<table>") -> tuple[TileKey, dict[int, TileConfig]]:
        required = ("E", "N", "K", "dtype", "quant", "device", "tiles")
        if not isinstance(doc, dict) or any(r not in doc for r in required):
            raise ValueError(f"tile table {source} must be a mapping with keys {list(required)}")
        key = TileKey(int(doc["E"]), int(doc["N"]), int(doc["K"]), str(doc["dtype"]), str(doc["quant"]),
                      str(doc["device"]))
        try:
            buckets = {int(m): TileConfig.from_dict(t) for m, t in doc["tiles"].items()}
        except (TypeError, ValueError) as exc:
            raise ValueError(f"tile table {source}: {exc}") from exc
        if not buckets:
            raise ValueError(f"tile table {source} has no tiles")
        return key, buckets

    @staticmethod
    def key_for(E: int, N: int, K: int, dtype: torch.dtype, quant: QuantConfig, device: str) -> TileKey:
        return TileKey(int(E), int(N), int(K), dtype_name(dtype), quant.name, device)

    def lookup(self, key: TileKey, M: int) -> Optional[TileConfig]:
        """The tuned tiles for M tokens, or None when no table matches `key`."""
        buckets = self.tables.get(key)
        if not buckets:
            return None
        target = math.log2(max(M, 1))
        best = min(buckets, key=lambda b: (abs(math.log2(max(b, 1)) - target), b))
        return buckets[best]

    def select(self, M: int, E: int, N: int, K: int, topk: int, dtype: torch.dtype, quant: QuantConfig,
               device: str) -> TileConfig:
        """Tuned tiles when a table matches, else default_tile_config."""
        cfg = self.lookup(self.key_for(E, N, K, dtype, quant, device), M)
        if cfg is None:
            return default_tile_config(M, E, N, K, topk, dtype, quant, device)
        if quant.is_block:
            cfg = cfg.with_block_k_limit(quant.block_shape[1])
        return cfg

    @staticmethod
    def to_yaml(key: TileKey, buckets: dict[int, TileConfig], comment: str = "") -> str:
        """A table as YAML text (what `load` reads back)."""
        lines = [f"# {line}" for line in comment.splitlines()] if comment else []
        lines += [f"E: {key.E}", f"N: {key.N}", f"K: {key.K}", f"dtype: {key.dtype}", f"quant: {key.quant}",
                  f"device: {key.device}", "tiles:"]
        for m in sorted(buckets):
            d = buckets[m].to_dict()
            inner = ", ".join(f"{k}: {v}" for k, v in d.items() if k != "gemm2")
            if "gemm2" in d:
                inner += ", gemm2: {" + ", ".join(f"{k}: {v}" for k, v in d["gemm2"].items()) + "}"
            lines.append(f"  {m}: {{{inner}}}")
        return "\n".join(lines) + "\n"

    @staticmethod
    def file_name(key: TileKey) -> str:
        return f"E{key.E}_N{key.N}_K{key.K}_{key.dtype}_{key.quant}_{key.device}.yaml"
