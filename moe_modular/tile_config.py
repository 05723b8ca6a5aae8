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
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Optional

import torch

from moe_modular.config import dtype_name
from moe_modular.kernels.gemm_config import DEFAULT_LAUNCH, GemmTile, LaunchOptions
from moe_modular.quant import QuantConfig

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
CPU_DEVICE_NAME = "cpu"
_SHAPE_FIELDS = tuple(f.name for f in fields(GemmTile))
_LAUNCH_FIELDS = tuple(f.name for f in fields(LaunchOptions))
# A table entry's fields in the order tables list them; the launch options and act_q (0 = off) only where set.
TILE_FIELDS = _SHAPE_FIELDS + ("b_tma", "a_tma", "act_q", "persistent", "ws", "pdl")
GEMMS = ("gemm1", "gemm2")
_OFF_BY_DEFAULT = _LAUNCH_FIELDS + ("act_q",)
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
    """Tiles and launch options of both grouped GEMMs of one forward; they share BLOCK_M (the alignment block).

    act_q: 1 (fp8-block, standard format) runs the activation and its 1 x group quantization of the intermediate in
    the first GEMM's epilogue.
    """

    gemm1: GemmTile
    gemm2: GemmTile
    launch1: LaunchOptions = DEFAULT_LAUNCH
    launch2: LaunchOptions = DEFAULT_LAUNCH
    act_q: int = 0

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
        if self.act_q not in (0, 1):
            raise ValueError(f"TileConfig.act_q ({self.act_q!r}) must be 0 or 1")

    @property
    def block_m(self) -> int:
        return self.gemm1.BLOCK_M

    @classmethod
    def from_dict(cls, d: dict) -> "TileConfig":
        """A table entry: the first GEMM's tile and launch fields and act_q flat, the second GEMM's differences
        under gemm2 (not BLOCK_M, not act_q)."""
        unknown = set(d) - set(TILE_FIELDS) - {"gemm2"}
        if unknown:
            raise ValueError(f"tile entry has unknown fields {sorted(unknown)}; allowed: {list(TILE_FIELDS)} + gemm2")
        over = dict(d.get("gemm2") or {})
        for f in ("BLOCK_M", "act_q"):
            if f in over:
                raise ValueError(f"tile entry gemm2 may not override {f} (both GEMMs share the alignment block; act_q "
                                 f"is the first GEMM's epilogue)")
        allowed = _SHAPE_FIELDS[1:] + _LAUNCH_FIELDS
        bad = set(over) - set(allowed)
        if bad:
            raise ValueError(f"tile entry gemm2 has unknown fields {sorted(bad)}; allowed: {list(allowed)}")
        first = {f: int(d[f]) for f in TILE_FIELDS if f in d}
        return cls.from_gemm_fields(first, {**first, **{k: int(v) for k, v in over.items()}})

    @classmethod
    def from_gemm_fields(cls, first: dict, second: dict) -> "TileConfig":
        """From each GEMM's flat fields (TILE_FIELDS; absent ones take their defaults); act_q is the first GEMM's,
        and the second's, where given, must be the same."""
        act_q = first.get("act_q", 0)
        if second.get("act_q", act_q) != act_q:
            raise ValueError(f"act_q is the first GEMM's epilogue: gemm2's act_q ({second['act_q']!r}) must equal "
                             f"gemm1's ({act_q!r})")
        return cls(_pick(GemmTile, _SHAPE_FIELDS, first), _pick(GemmTile, _SHAPE_FIELDS, second),
                   _pick(LaunchOptions, _LAUNCH_FIELDS, first), _pick(LaunchOptions, _LAUNCH_FIELDS, second), act_q)

    def gemm_fields(self, which: str) -> dict:
        """The flat fields (TILE_FIELDS) of "gemm1" or "gemm2": its tile, its launch options and act_q."""
        if which not in GEMMS:
            raise ValueError(f"which ({which!r}) must be one of {list(GEMMS)}")
        tile, launch = (self.gemm1, self.launch1) if which == "gemm1" else (self.gemm2, self.launch2)
        d = {**asdict(tile), **asdict(launch), "act_q": self.act_q}
        return {f: d[f] for f in TILE_FIELDS}

    def to_dict(self) -> dict:
        """The table entry (from_dict's spelling)."""
        d, second = self.gemm_fields("gemm1"), self.gemm_fields("gemm2")
        over = {k: v for k, v in second.items() if d[k] != v}
        d = {k: v for k, v in d.items() if k not in _OFF_BY_DEFAULT or v}  # tables list flags only where set
        if over:
            d["gemm2"] = over
        return d

    def with_block_k_limit(self, limit: int) -> "TileConfig":
        """The same tiles with BLOCK_K capped at `limit` (a group size the K tiles must not straddle)."""
        return replace(self, gemm1=replace(self.gemm1, BLOCK_K=min(self.gemm1.BLOCK_K, limit)),
                       gemm2=replace(self.gemm2, BLOCK_K=min(self.gemm2.BLOCK_K, limit)))


def _pick(cls, names: tuple[str, ...], values: dict):
    return cls(**{f: values[f] for f in names if f in values})


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
        tile, launch = GemmTile(128, 256, 64, 8, 8, 4), LaunchOptions(a_tma=1, ws=1)
        return TileConfig(tile, tile, launch, launch)
    fp8_ws = fp8_ws_tile_configs(quant)
    return fp8_ws[0] if fp8_ws else None


# The fp8 warp-specialized kernel's one tile (kernels/common.FP8_WS_TILE with FP8_WS_WARPS warps, restated here
# where Triton is not imported; a test holds them equal) and its wide form of two column halves. GROUP_M is the
# tables'; the kernel sizes its own stage ring, and 3 stages fit the tl.dot kernel the tile falls back to.
FP8_WS_HALF = GemmTile(128, 128, 128, 8, 8, 3)
FP8_WS_WIDE = replace(FP8_WS_HALF, BLOCK_N=2 * FP8_WS_HALF.BLOCK_N)


def fp8_ws_tile_configs(quant: QuantConfig) -> tuple[TileConfig, ...]:
    """The configurations that run both GEMMs in the fp8 warp-specialized kernel (ws) for a scheme it takes, the
    tables' choice first; () for other schemes. fp8 128 x 128 blocks: the first GEMM with act_q (its gate and up
    halves, so twice BLOCK_N in the tables' spelling), the second GEMM of one column half, then wide. fp8
    per-token: both GEMMs of one half, then the second wide, then both wide."""
    ws = LaunchOptions(ws=1)
    if quant == QuantConfig.fp8_block((FP8_WS_HALF.BLOCK_N, FP8_WS_HALF.BLOCK_K)):
        return tuple(TileConfig(FP8_WS_WIDE, g2, ws, ws, act_q=1) for g2 in (FP8_WS_HALF, FP8_WS_WIDE))
    if quant == QuantConfig.fp8_per_token():
        pairs = ((FP8_WS_HALF, FP8_WS_HALF), (FP8_WS_HALF, FP8_WS_WIDE), (FP8_WS_WIDE, FP8_WS_WIDE))
        return tuple(TileConfig(g1, g2, ws, ws) for g1, g2 in pairs)
    return ()


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
