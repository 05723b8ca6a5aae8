"""DeepEP managers: one `deep_ep.Buffer` per buffer config, shared by every layer that asks for it.

Two modes, two managers (both registered in all2all.base):
  DeepEPHighThroughputManager  (deepep_high_throughput) NVLink buffer sized from DeepEP's own
      dispatch / combine Config hints for the token width; when the ranks span nodes (more than
      NUM_MAX_NVL_PEERS ranks) an RDMA buffer sized the same way and QPs_PER_CHANNEL QPs per channel.
  DeepEPLowLatencyManager      (deepep_low_latency) RDMA buffer of
      Buffer.get_low_latency_rdma_size_hint(max tokens per rank, hidden, ranks, experts) and one QP
      per local expert.

The token traffic of the DeepEP PrepareAndFinalize classes goes through the handle's Buffer; the
generic row exchange of the All2AllManager interface (dispatch / combine of rows) is inherited
from NcclAllToAllManager and moves small per-step rows over the group's all_to_all_single.

Everything here imports without deep_ep: the module is looked up when a manager is built (or
given to it, so tests can pass a stand-in), and `supports()` answers (False, "deep_ep is not
installed") when it is missing. No module-level mutable state.

DeepEP facts this module encodes (DeepEP V1 `deep_ep.Buffer` API):
  * intranode high-throughput kernels exist for 2, 4 or 8 ranks; above 8 ranks the count must be a
    multiple of 8 with a node count in HT_INTERNODE_NODES (16, 24, 32, 48, 64, 96, 128, 144, 160 ranks);
  * high-throughput kernels copy token rows in units of 32 lanes x 16 bytes, so a row's bytes are
    padded to HT_ROW_ALIGN_BYTES; combine takes bf16 only; top-k <= 32;
  * low-latency kernels are compiled for the hidden sizes in LL_HIDDEN_SIZES only, bf16 input,
    top-k <= LL_MAX_TOPK, at least LL_MIN_EXPERTS experts, and the same max tokens per rank on every
    rank; ranks x max tokens per rank must be a multiple of LL_TOKEN_MULTIPLE (the receive buffers are
    TMA-copied), so the buffer's tokens per rank are rounded up (ll_dispatch_tokens);
  * every low-latency Buffer initialises NVSHMEM for the process (and destroy() finalises it): one LL
    Buffer per manager, shared by every layer whose config it covers; its queue pairs are
    NVSHMEM_QP_DEPTH deep (DeepEP's default 1024), and a dispatch needs 2 x (tokens per rank + 1) of
    them, so more than 511 tokens per rank need NVSHMEM_QP_DEPTH raised before the Buffer is built.

Shape legend: W ranks (ep size), E global experts, El = E / W local experts, K hidden.
"""
from __future__ import annotations

import importlib
import inspect
import math
import os
from abc import abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, Optional

import torch

from all2all.base import All2AllHandle
from all2all.nccl_all_to_all import NcclAllToAllManager

DEEP_EP_MODULE = "deep_ep"
DEEP_EP_MISSING = "deep_ep is not installed"

NUM_MAX_NVL_PEERS = 8  # ranks one DeepEP NVLink domain holds
HT_INTRANODE_RANKS: tuple[int, ...] = (2, 4, 8)
HT_INTERNODE_NODES: tuple[int, ...] = (2, 3, 4, 6, 8, 12, 16, 18, 20)
HT_ROW_ALIGN_BYTES = 512  # 32 lanes x sizeof(int4)
HT_MAX_TOPK = 32
HT_COMBINE_DTYPE = torch.bfloat16
QPS_PER_CHANNEL_DIVISOR = 2  # internode HT: one QP per channel, a channel per 2 SMs
LL_HIDDEN_SIZES: tuple[int, ...] = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
LL_MAX_TOPK = 11
LL_MIN_EXPERTS = 2  # the dispatch kernel needs two SMs' worth of experts
LL_TOKEN_MULTIPLE = 4  # ranks x tokens per rank (the receive buffers' rows are TMA-copied)
LL_DEFAULT_QP_DEPTH = 1024  # DeepEP's NVSHMEM_QP_DEPTH when the environment sets none
LL_SCALE_GROUP = 128  # low-latency fp8 dispatch: one float32 scale per 1 x 128 group


# ---- the import gate ------------------------------------------------------------------------

def load_deep_ep() -> Optional[ModuleType]:
    """The deep_ep module, or None when it cannot be imported (sys.modules caches the import)."""
    try:
        return importlib.import_module(DEEP_EP_MODULE)
    except ImportError:
        return None


def deep_ep_unavailable_reason() -> Optional[str]:
    """None when deep_ep imports, else the reason the DeepEP classes give for not running."""
    return None if load_deep_ep() is not None else DEEP_EP_MISSING


# ---- rank counts ------------------------------------------------------------------------------

def spans_nodes(world_size: int) -> bool:
    """True when the ranks do not fit in one NVLink domain (DeepEP's internode case)."""
    return world_size > NUM_MAX_NVL_PEERS


def ht_allowed_rank_counts() -> list[int]:
    """Every rank count the high-throughput kernels run: intranode, then internode."""
    return list(HT_INTRANODE_RANKS) + [n * NUM_MAX_NVL_PEERS for n in HT_INTERNODE_NODES]


def ht_rank_count_error(world_size: int) -> Optional[str]:
    """None when DeepEP's high-throughput kernels run on `world_size` ranks, else why not."""
    if world_size in ht_allowed_rank_counts():
        return None
    if not spans_nodes(world_size):
        return (f"ep_size ({world_size}) is not a rank count DeepEP high-throughput kernels run intranode; "
                f"allowed: {list(HT_INTRANODE_RANKS)} (internode: {ht_allowed_rank_counts()[len(HT_INTRANODE_RANKS):]})")
    return (f"ep_size ({world_size}) is not a rank count DeepEP high-throughput kernels run internode; it must be "
            f"{NUM_MAX_NVL_PEERS} x nodes with nodes in {list(HT_INTERNODE_NODES)}, i.e. one of "
            f"{ht_allowed_rank_counts()[len(HT_INTRANODE_RANKS):]} (intranode: {list(HT_INTRANODE_RANKS)})")


def ll_rank_count_error(world_size: int) -> Optional[str]:
    """None when a low-latency Buffer can be built over `world_size` ranks, else why not.

    DeepEP's Buffer takes fewer than NUM_MAX_NVL_PEERS ranks, or a multiple of it."""
    if world_size >= 1 and (world_size < NUM_MAX_NVL_PEERS or world_size % NUM_MAX_NVL_PEERS == 0):
        return None
    return (f"ep_size ({world_size}) is not a rank count DeepEP low-latency buffers take; allowed: "
            f"1 to {NUM_MAX_NVL_PEERS - 1}, or a multiple of {NUM_MAX_NVL_PEERS}")


def ll_dispatch_tokens(max_num_tokens: int, world_size: int) -> int:
    """Tokens per rank a low-latency buffer is built for: max_num_tokens rounded up so that world_size x tokens
    is a multiple of LL_TOKEN_MULTIPLE (the same on every rank: it depends on both only)."""
    if not isinstance(max_num_tokens, int) or max_num_tokens < 1:
        raise ValueError(f"max_num_tokens ({max_num_tokens!r}) must be an int >= 1")
    step = LL_TOKEN_MULTIPLE // math.gcd(LL_TOKEN_MULTIPLE, world_size)
    return -(-max_num_tokens // step) * step


def ll_max_tokens_for_qp_depth(qp_depth: int) -> int:
    """The most tokens per rank a low-latency dispatch takes with queue pairs qp_depth deep."""
    return qp_depth // 2 - 1


def ll_qp_depth_error(tokens_per_rank: int, qp_depth: int) -> Optional[str]:
    """None when queue pairs qp_depth deep hold a dispatch of tokens_per_rank, else why not and what to set."""
    if tokens_per_rank <= ll_max_tokens_for_qp_depth(qp_depth):
        return None
    return (f"max_num_tokens ({tokens_per_rank} per rank in the low-latency buffer) must be <= "
            f"{ll_max_tokens_for_qp_depth(qp_depth)} with NVSHMEM_QP_DEPTH {qp_depth}; set NVSHMEM_QP_DEPTH to at "
            f"least {2 * (tokens_per_rank + 1)} before the process group's DeepEP manager is made")


# ---- hidden sizes -----------------------------------------------------------------------------

def ht_padded_hidden(hidden: int, element_sizes: tuple[int, ...]) -> int:
    """The smallest hidden size >= `hidden` whose rows are whole HT_ROW_ALIGN_BYTES units for every
    element size in `element_sizes` (the dtypes a row travels in: 1 for fp8, 2 for bf16)."""
    if not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"hidden ({hidden!r}) must be an int >= 1")
    if not element_sizes or any(s not in (1, 2, 4) for s in element_sizes):
        raise ValueError(f"element_sizes ({element_sizes!r}) must be a non-empty tuple of 1, 2 or 4")
    unit = HT_ROW_ALIGN_BYTES // min(element_sizes)  # elements per aligned unit of the narrowest dtype
    return -(-hidden // unit) * unit


def ll_hidden_size(hidden: int) -> int:
    """The smallest low-latency kernel hidden size >= `hidden`; a clear error above the largest."""
    if not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"hidden ({hidden!r}) must be an int >= 1")
    for h in LL_HIDDEN_SIZES:
        if h >= hidden:
            return h
    raise ValueError(
        f"hidden_dim ({hidden}) is larger than every hidden size DeepEP low-latency kernels are built for; "
        f"allowed (a smaller hidden is padded up to the next): {list(LL_HIDDEN_SIZES)}")


# ---- buffer configs and handles ----------------------------------------------------------------

@dataclass(frozen=True)
class DeepEPHTBufferConfig:
    """What sizes a high-throughput Buffer: the bytes of one token row (hidden x max(element size, 2),
    DeepEP's convention). Token counts do not enter: HT buffers are chunked."""

    hidden_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.hidden_bytes, int) or self.hidden_bytes < 1 or self.hidden_bytes % 16:
            raise ValueError(f"DeepEPHTBufferConfig.hidden_bytes ({self.hidden_bytes!r}) must be a positive "
                             f"multiple of 16")


@dataclass(frozen=True)
class DeepEPLLBufferConfig:
    """What sizes a low-latency Buffer.

    max_dispatch_tokens_per_rank: the most tokens any rank dispatches (the same on every rank).
    hidden: the kernel hidden size (one of LL_HIDDEN_SIZES).  num_experts: global E.
    """

    max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int

    def __post_init__(self) -> None:
        for name in ("max_dispatch_tokens_per_rank", "num_experts"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"DeepEPLLBufferConfig.{name} ({v!r}) must be an int >= 1")
        if self.hidden not in LL_HIDDEN_SIZES:
            raise ValueError(f"DeepEPLLBufferConfig.hidden ({self.hidden!r}) must be one of {list(LL_HIDDEN_SIZES)}")


@dataclass(frozen=True)
class DeepEPBufferSizes:
    """The arguments a Buffer is built with."""

    num_nvl_bytes: int
    num_rdma_bytes: int
    low_latency_mode: bool
    num_qps_per_rank: int


def ht_buffer_sizes(deep_ep_module: Any, world_size: int, config: DeepEPHTBufferConfig) -> DeepEPBufferSizes:
    """High-throughput Buffer arguments: NVLink bytes are the larger of the dispatch and combine
    Configs' hints for the row bytes. When the ranks span nodes, RDMA bytes the same way and one QP
    per channel (Buffer.num_sms / 2); intranode, no RDMA buffer and one QP."""
    if not isinstance(config, DeepEPHTBufferConfig):
        raise TypeError(f"high-throughput buffers need a DeepEPHTBufferConfig, got {type(config).__name__}")
    buffer_cls = deep_ep_module.Buffer
    configs = (buffer_cls.get_dispatch_config(world_size), buffer_cls.get_combine_config(world_size))
    nvl = max(int(c.get_nvl_buffer_size_hint(config.hidden_bytes, world_size)) for c in configs)
    if not spans_nodes(world_size):
        return DeepEPBufferSizes(nvl, 0, False, 1)
    rdma = max(int(c.get_rdma_buffer_size_hint(config.hidden_bytes, world_size)) for c in configs)
    qps = max(1, int(buffer_cls.num_sms) // QPS_PER_CHANNEL_DIVISOR)
    return DeepEPBufferSizes(nvl, rdma, False, qps)


def ll_buffer_sizes(deep_ep_module: Any, world_size: int, config: DeepEPLLBufferConfig) -> DeepEPBufferSizes:
    """Low-latency Buffer arguments: RDMA bytes from DeepEP's size hint, one QP per local expert,
    no NVLink buffer."""
    if not isinstance(config, DeepEPLLBufferConfig):
        raise TypeError(f"low-latency buffers need a DeepEPLLBufferConfig, got {type(config).__name__}")
    if config.num_experts % world_size:
        raise ValueError(f"num_experts ({config.num_experts}) must be divisible by ep_size ({world_size})")
    rdma = deep_ep_module.Buffer.get_low_latency_rdma_size_hint(
        config.max_dispatch_tokens_per_rank, config.hidden, world_size, config.num_experts)
    return DeepEPBufferSizes(0, int(rdma), True, config.num_experts // world_size)


class DeepEPBufferHandle(All2AllHandle):
    """One deep_ep.Buffer (and the sizes it was built with); destroyed at most once."""

    def __init__(self, config: Any, device: torch.device, buffer: Any, sizes: DeepEPBufferSizes,
                 explicit_destroy: bool) -> None:
        super().__init__(config, device)
        self.deep_ep_buffer = buffer
        self.sizes = sizes
        self._explicit_destroy = explicit_destroy
        self._destroyed = False

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def destroy(self) -> None:
        """Release the Buffer: Buffer.destroy() when it was built for explicit destruction, else the
        last reference is dropped. Later calls do nothing."""
        if self._destroyed:
            return
        self._destroyed = True
        buffer, self.deep_ep_buffer = self.deep_ep_buffer, None
        if self._explicit_destroy and buffer is not None:
            buffer.destroy()


def _accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class _DeepEPManager(NcclAllToAllManager):
    """Shared by both modes: the deep_ep module, per-config Buffer handles, destroy-once.

    group: an initialized process group (NCCL for real buffers).  device: cuda:<current> for NCCL.
    deep_ep_module: the module providing Buffer (imported when None; tests pass a stand-in).
    """

    backend_name: ClassVar[str] = ""
    low_latency_mode: ClassVar[bool] = False

    def __init__(self, group: Any, device: Optional[torch.device] = None,
                 deep_ep_module: Optional[ModuleType] = None) -> None:
        module = deep_ep_module if deep_ep_module is not None else load_deep_ep()
        if module is None:
            raise RuntimeError(f"{type(self).__name__} ({self.backend_name}): {DEEP_EP_MISSING}")
        super().__init__(group, device)
        error = self.rank_count_error(self.world_size)
        if error is not None:
            raise ValueError(f"{type(self).__name__}: {error}")
        self.deep_ep = module

    @classmethod
    def supports(cls) -> tuple[bool, str]:
        """(True, "") when deep_ep imports here, else (False, "deep_ep is not installed")."""
        reason = deep_ep_unavailable_reason()
        return (reason is None), (reason or "")

    @classmethod
    @abstractmethod
    def rank_count_error(cls, world_size: int) -> Optional[str]:
        """None when this mode runs on `world_size` ranks, else the reason with the allowed set."""

    @abstractmethod
    def buffer_sizes(self, config: Any) -> DeepEPBufferSizes:
        """The Buffer arguments for `config` (pure arithmetic over DeepEP's hints)."""

    def _make_handle(self, config: Any) -> DeepEPBufferHandle:
        sizes = self.buffer_sizes(config)
        buffer_cls = self.deep_ep.Buffer
        kwargs: dict[str, Any] = dict(low_latency_mode=sizes.low_latency_mode, num_qps_per_rank=sizes.num_qps_per_rank)
        explicit = _accepts(buffer_cls, "explicitly_destroy")
        if explicit:
            kwargs["explicitly_destroy"] = True
        if sizes.low_latency_mode and _accepts(buffer_cls, "allow_nvlink_for_low_latency_mode"):
            kwargs["allow_nvlink_for_low_latency_mode"] = True
        buffer = buffer_cls(self.group, sizes.num_nvl_bytes, sizes.num_rdma_bytes, **kwargs)
        return DeepEPBufferHandle(config, self.device, buffer, sizes, explicit)

    def destroy(self) -> None:
        """Destroy every Buffer once, then drop the handles (idempotent)."""
        if self.destroyed:
            return
        for handle in self._handles.values():
            handle.destroy()
        super().destroy()


class DeepEPHighThroughputManager(_DeepEPManager):
    """deep_ep.Buffer in high-throughput (normal) mode, one per DeepEPHTBufferConfig."""

    backend_name: ClassVar[str] = "deepep_high_throughput"
    low_latency_mode: ClassVar[bool] = False

    @classmethod
    def rank_count_error(cls, world_size: int) -> Optional[str]:
        return ht_rank_count_error(world_size)

    def dispatch_config(self) -> Any:
        """DeepEP's recommended dispatch Config for this many ranks."""
        return self.deep_ep.Buffer.get_dispatch_config(self.world_size)

    def combine_config(self) -> Any:
        """DeepEP's recommended combine Config for this many ranks."""
        return self.deep_ep.Buffer.get_combine_config(self.world_size)

    def buffer_sizes(self, config: DeepEPHTBufferConfig) -> DeepEPBufferSizes:
        return ht_buffer_sizes(self.deep_ep, self.world_size, config)


class DeepEPLowLatencyManager(_DeepEPManager):
    """deep_ep.Buffer in low-latency mode: one Buffer (one NVSHMEM initialisation) for the manager, built for the
    first DeepEPLLBufferConfig asked for and shared by every later config it covers (no more RDMA bytes, no more
    queue pairs per rank); a config it does not cover is refused, naming both. qp_depth: NVSHMEM_QP_DEPTH as the
    environment sets it when the manager is made (DeepEP's default 1024 when unset), which bounds the tokens
    per rank (ll_qp_depth_error)."""

    backend_name: ClassVar[str] = "deepep_low_latency"
    low_latency_mode: ClassVar[bool] = True

    def __init__(self, group: Any, device: Optional[torch.device] = None,
                 deep_ep_module: Optional[ModuleType] = None) -> None:
        super().__init__(group, device, deep_ep_module)
        self.qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", LL_DEFAULT_QP_DEPTH))
        self._owner: Optional[DeepEPBufferHandle] = None  # the handle that built the Buffer

    @classmethod
    def rank_count_error(cls, world_size: int) -> Optional[str]:
        return ll_rank_count_error(world_size)

    def buffer_sizes(self, config: DeepEPLLBufferConfig) -> DeepEPBufferSizes:
        return ll_buffer_sizes(self.deep_ep, self.world_size, config)

    def _make_handle(self, config: DeepEPLLBufferConfig) -> DeepEPBufferHandle:
        error = ll_qp_depth_error(config.max_dispatch_tokens_per_rank, self.qp_depth)
        if error is not None:
            raise ValueError(f"{type(self).__name__}: {error}")
        owner = self._owner
        if owner is None:
            self._owner = super()._make_handle(config)
            return self._owner
        sizes = self.buffer_sizes(config)
        built = owner.sizes
        if sizes.num_rdma_bytes > built.num_rdma_bytes or sizes.num_qps_per_rank > built.num_qps_per_rank:
            raise ValueError(
                f"{type(self).__name__}: this process's DeepEP low-latency buffer was built for {owner.config} "
                f"({built.num_rdma_bytes} RDMA bytes, {built.num_qps_per_rank} queue pairs per rank); {config} needs "
                f"{sizes.num_rdma_bytes} bytes and {sizes.num_qps_per_rank} queue pairs, and a second buffer would "
                f"initialise NVSHMEM again. Make the layer with the most tokens per rank, hidden size and experts "
                f"first, or give every layer the same max_num_tokens")
        # the same Buffer under this config's handle; destroying it leaves the Buffer to its owner
        return DeepEPBufferHandle(config, self.device, owner.deep_ep_buffer, built, explicit_destroy=False)

    def destroy(self) -> None:
        super().destroy()
        self._owner = None

    def dispatch_accepts(self, name: str) -> bool:
        """Whether this deep_ep build's low_latency_dispatch takes keyword `name` (e.g. use_fp8)."""
        return _accepts(self.deep_ep.Buffer.low_latency_dispatch, name)

    def combine_accepts(self, name: str) -> bool:
        return _accepts(self.deep_ep.Buffer.low_latency_combine, name)


def ll_dispatch_has_use_fp8(module: Optional[ModuleType] = None) -> bool:
    """True when the installed (or given) deep_ep's low_latency_dispatch can send bf16 (use_fp8=False);
    the first releases always cast to fp8 with 1 x 128 scales."""
    module = module if module is not None else load_deep_ep()
    return module is not None and _accepts(module.Buffer.low_latency_dispatch, "use_fp8")
