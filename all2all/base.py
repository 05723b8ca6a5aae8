"""All2AllManager: the communication layer under the expert-parallel PrepareAndFinalize classes.

A manager is built from a process group. It moves *rows* (dim 0 of a tensor; the PFs pack a
token's activations, scales, ids and weights into one uint8 row so one collective moves them all)
and caches one All2AllHandle per distinct All2AllHandleConfig, so every layer with the same
shapes shares the same buffers. `destroy()` is idempotent.

Two families of semantics (each manager's docstring says which it follows):
  gather   (naive, allgather_reducescatter): dispatch delivers every rank's rows to every rank,
           concatenated in rank order; combine sums rows over ranks and returns this rank's.
  exchange (nccl_all_to_all, nccl_low_latency): dispatch sends rows grouped by destination rank
           and returns the rows received, grouped by source rank; combine is the exact reverse.

Backends are named in a registry (name -> "module:Class", imported on first use so that names
whose dependency is missing still list and fail with a clear reason).

Shape legend: W world size (ranks), R rows, B bytes per row.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Generic, Mapping, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from all2all.buffers import WorkspaceCache

T = TypeVar("T")

# Backend name -> "module:Class". Read-only; the classes are imported on first use.
ALL2ALL_BACKENDS: Mapping[str, str] = MappingProxyType({
    "naive": "all2all.naive:NaiveAll2AllManager",
    "allgather_reducescatter": "all2all.allgather_reducescatter:AllGatherReduceScatterManager",
    "nccl_all_to_all": "all2all.nccl_all_to_all:NcclAllToAllManager",
    "nccl_low_latency": "all2all.nccl_low_latency:NcclLowLatencyManager",
    "deepep_high_throughput": "all2all.deepep:DeepEPHighThroughputManager",
    "deepep_low_latency": "all2all.deepep:DeepEPLowLatencyManager",
    "symm_mem": "all2all.symm_mem:SymmMemManager",
})


def backend_names() -> tuple[str, ...]:
    return tuple(ALL2ALL_BACKENDS)


def resolve_backend(name: str) -> "type[All2AllManager]":
    """The manager class registered under `name`; unknown or unavailable names raise, listing the valid ones."""
    if name not in ALL2ALL_BACKENDS:
        raise ValueError(f"all2all backend ({name!r}) must be one of {list(ALL2ALL_BACKENDS)}")
    module_name, _, class_name = ALL2ALL_BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"all2all backend ({name!r}) is registered as {ALL2ALL_BACKENDS[name]} but is not available "
            f"in this installation ({exc}); available here: {available_backend_names()}"
        ) from None
    cls = getattr(module, class_name)
    if not (isinstance(cls, type) and issubclass(cls, All2AllManager)):
        raise TypeError(f"{ALL2ALL_BACKENDS[name]} is not an All2AllManager subclass")
    return cls


def available_backend_names() -> list[str]:
    """Registered names whose module imports in this installation."""
    out = []
    for name, target in ALL2ALL_BACKENDS.items():
        try:
            importlib.import_module(target.partition(":")[0])
        except ImportError:
            continue
        out.append(name)
    return out


@dataclass(frozen=True)
class All2AllHandleConfig:
    """What fixes a handle's buffer sizes (one handle per distinct config, shared across layers).

    max_num_tokens: the most tokens one rank dispatches in a forward.
    row_bytes: bytes of one dispatched row (activations + scales + routing, packed).
    num_experts: global expert count E.  topk: routes per token.
    """

    max_num_tokens: int
    row_bytes: int
    num_experts: int
    topk: int

    def __post_init__(self) -> None:
        for name in ("max_num_tokens", "row_bytes", "num_experts", "topk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"All2AllHandleConfig.{name} ({v!r}) must be an int >= 1")


class All2AllHandle:
    """Per-config communication buffers (grow-only, named), owned by one manager."""

    def __init__(self, config: All2AllHandleConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self._buffers = WorkspaceCache()

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A (possibly reused) uninitialized tensor of `shape`; its contents are whatever the last user left."""
        return self._buffers.get(name, tuple(shape), dtype, self.device)

    @property
    def num_allocations(self) -> int:
        return self._buffers.num_allocations


@dataclass(frozen=True)
class RowLayout:
    """How many rows this rank sends to and receives from each rank in one step (host ints).

    send_counts[r]: rows sent to rank r (W,).  recv_counts[r]: rows received from rank r (W,).
    """

    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.send_counts) != len(self.recv_counts):
            raise ValueError(
                f"RowLayout.send_counts ({len(self.send_counts)} ranks) and recv_counts "
                f"({len(self.recv_counts)} ranks) must have the same length"
            )
        if any(c < 0 for c in self.send_counts + self.recv_counts):
            raise ValueError(f"RowLayout counts must be >= 0, got {self.send_counts} / {self.recv_counts}")

    @property
    def num_send(self) -> int:
        return sum(self.send_counts)

    @property
    def num_recv(self) -> int:
        return sum(self.recv_counts)

    def reversed(self) -> "RowLayout":
        return RowLayout(self.recv_counts, self.send_counts)


class PendingCollective(Generic[T]):
    """A collective that may still be in flight; wait() completes it once and returns its result."""

    def __init__(self, works: Sequence[Any], finish: Callable[[], T]) -> None:
        self._works = [w for w in works if w is not None]
        self._finish: Optional[Callable[[], T]] = finish
        self._result: Optional[T] = None

    def wait(self) -> T:
        if self._finish is not None:
            for w in self._works:
                w.wait()
            self._works = []
            self._result = self._finish()
            self._finish = None
        return self._result  # type: ignore[return-value]

    @classmethod
    def done(cls, result: T) -> "PendingCollective[T]":
        return cls([], lambda: result)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False):
    """dist.all_gather_single where it exists (torch >= 2.13), all_gather_into_tensor before."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False):
    """Sum-reduce-scatter: dist.reduce_scatter_single where it exists, reduce_scatter_tensor before."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def group_device(group: Any) -> torch.device:
    """cuda:<current> for an NCCL group, cpu otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class All2AllManager(ABC):
    """Moves rows between the ranks of one process group; caches handles per config.

    group: an initialized torch.distributed process group.  device: where buffers live (the
    group's device when None: cuda under NCCL, cpu under gloo).
    """

    backend_name: ClassVar[str] = ""

    def __init__(self, group: Any, device: Optional[torch.device] = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs an initialized torch.distributed process group")
        self.group = group
        self.device = torch.device(device) if device is not None else group_device(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._handles: dict[All2AllHandleConfig, All2AllHandle] = {}
        self._destroyed = False

    # ---- handles --------------------------------------------------------------------------
    def get_handle(self, config: All2AllHandleConfig) -> All2AllHandle:
        """The handle for `config`, created on first request and shared afterwards."""
        self._check_alive()
        handle = self._handles.get(config)
        if handle is None:
            handle = self._make_handle(config)
            self._handles[config] = handle
        return handle

    def _make_handle(self, config: All2AllHandleConfig) -> All2AllHandle:
        return All2AllHandle(config, self.device)

    @property
    def num_handles(self) -> int:
        return len(self._handles)

    # ---- counts ---------------------------------------------------------------------------
    def exchange_counts(self, send_counts_W: torch.Tensor) -> RowLayout:
        """All-to-all of per-destination row counts (W,) int; one host sync per step."""
        self._check_alive()
        if send_counts_W.numel() != self.world_size:
            raise ValueError(
                f"send_counts_W has {send_counts_W.numel()} entries; it must have world_size ({self.world_size})"
            )
        send = send_counts_W.to(device=self.device, dtype=torch.int64).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return RowLayout(tuple(int(c) for c in send.tolist()), tuple(int(c) for c in recv.tolist()))

    def gather_counts(self, num_rows: int) -> RowLayout:
        """Every rank's row count, for the gather family (each rank sends its rows to all)."""
        self._check_alive()
        mine = torch.tensor([num_rows], dtype=torch.int64, device=self.device)
        counts = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        all_gather_single(counts, mine, self.group)
        return RowLayout((num_rows,) * self.world_size, tuple(int(c) for c in counts.tolist()))

    # ---- the collectives -------------------------------------------------------------------
    @abstractmethod
    def dispatch(self, handle: All2AllHandle, rows_RB: torch.Tensor, layout: RowLayout,
                 async_op: bool = False, tag: str = "rows") -> PendingCollective[torch.Tensor]:
        """Send rows_RB (R, B) (any dtype; 2-D) as the family's semantics say; see the class docstring.

        The result may live in a handle buffer named after `tag`: it stays valid until the next
        call with the same tag on the same handle, so collectives in flight together need distinct tags."""

    @abstractmethod
    def combine(self, handle: All2AllHandle, rows_RB: torch.Tensor, layout: RowLayout,
                async_op: bool = False, tag: str = "rows") -> PendingCollective[torch.Tensor]:
        """The reverse of dispatch for the same layout; see the class docstring."""

    # ---- lifecycle -------------------------------------------------------------------------
    def destroy(self) -> None:
        """Drop every handle; later calls are no-ops, later use raises."""
        if self._destroyed:
            return
        self._handles.clear()
        self._destroyed = True

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError(f"{type(self).__name__} ({self.backend_name}) was destroyed")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, device={self.device})"


def check_rows(rows_RB: torch.Tensor, expected_rows: int, what: str) -> None:
    """rows_RB must be 2-D with `expected_rows` rows."""
    if rows_RB.dim() != 2:
        raise ValueError(f"{what}: rows must be 2-D (R, B), got shape {tuple(rows_RB.shape)}")
    if rows_RB.size(0) != expected_rows:
        raise ValueError(f"{what}: rows ({rows_RB.size(0)}) must equal the layout's count ({expected_rows})")
