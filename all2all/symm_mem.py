"""SymmMemManager: token exchange on torch.distributed._symmetric_memory (NVSHMEM backend).

Dispatch is torch's `all_to_all_vdev_2d` (rows sent rank-major, by destination rank then its local
expert, arrive expert-major: by local expert, then source rank); combine is
`all_to_all_vdev_2d_offset`, its reverse, which takes the dispatch's output splits and offsets as
its input layout and returns every row to its sender in the original send order.

These ops read and write symmetric buffers only (every rank allocates the same shapes in the same
order), so the manager keeps a SymmMemBufferCache: one buffer per (process group name, buffer
name, row shape, dtype), shared by every layer, grown to the capacity the largest layer needs
(rounded up to CAPACITY_ALIGN_ROWS rows; growing drops the old buffer before allocating the new
one) and released by destroy_symm_mem_buffers(). Buffers are reserved when a PrepareAndFinalize is
built, so growth happens at construction, in the same order on every rank. The dispatch's output
splits and offsets, which the combine reads back, are kept per layout slot (LAYOUT_SLOTS of them): two
micro-batches in flight dispatch and combine through different slots.

The ops need at least 2 ranks (a single rank is refused, not emulated), at most
MAX_WORLD_SIZE ranks and at most MAX_LOCAL_EXPERTS experts per rank (torch's kernels scan splits
with one warp per rank or expert). The generic row exchange of the All2AllManager interface is
inherited from NcclAllToAllManager.

The symmetric-memory calls go through a SymmMemBackend object (torch's by default) so the buffer
arithmetic and the PrepareAndFinalize logic can be exercised with a stand-in.

Shape legend: W ranks, El local experts, B bytes per dispatched row, Bc bytes per combined row,
Cs / Cr send / receive capacity in rows.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from all2all.nccl_all_to_all import NcclAllToAllManager

CAPACITY_ALIGN_ROWS = 384
MIN_WORLD_SIZE = 2
MAX_WORLD_SIZE = 16  # all_to_all_vdev_2d_offset: world_size <= 16
MAX_LOCAL_EXPERTS = 16  # all_to_all_vdev_2d: experts per rank <= 16
SYMM_MEM_BACKEND_NAME = "NVSHMEM"


# ---- availability -----------------------------------------------------------------------------

def world_size_error(world_size: int) -> Optional[str]:
    """None when torch's 2-D all-to-all ops run on `world_size` ranks, else why not."""
    if MIN_WORLD_SIZE <= world_size <= MAX_WORLD_SIZE:
        return None
    if world_size < MIN_WORLD_SIZE:
        return (f"ep_size ({world_size}) must be in [{MIN_WORLD_SIZE}, {MAX_WORLD_SIZE}]: torch's symmetric-memory "
                f"all_to_all_vdev_2d / all_to_all_vdev_2d_offset do not support a single rank")
    return (f"ep_size ({world_size}) must be in [{MIN_WORLD_SIZE}, {MAX_WORLD_SIZE}]: torch's "
            f"all_to_all_vdev_2d_offset supports at most {MAX_WORLD_SIZE} ranks")


def local_experts_error(num_local_experts: int) -> Optional[str]:
    if num_local_experts <= MAX_LOCAL_EXPERTS:
        return None
    return (f"local experts per rank ({num_local_experts}) must be <= {MAX_LOCAL_EXPERTS}: torch's "
            f"all_to_all_vdev_2d scans one warp of splits per local expert")


def runtime_unavailable_reason() -> Optional[str]:
    """None when this process can allocate NVSHMEM symmetric memory, else why not."""
    if not torch.cuda.is_available():
        return "torch symmetric memory (NVSHMEM) needs CUDA GPUs; CUDA is not available here"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory is not available in this torch build ({exc})"
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d_offset"):
        return f"this torch ({torch.__version__}) has no symm_mem.all_to_all_vdev_2d_offset op"
    if not symm_mem.is_nvshmem_available():
        return "NVSHMEM is not available to torch here (libnvshmem_host.so.3 not found: install nvidia-nvshmem)"
    return None


# ---- capacity arithmetic ----------------------------------------------------------------------

def aligned_capacity(rows: int) -> int:
    """`rows` rounded up to a whole number of CAPACITY_ALIGN_ROWS blocks (at least one block)."""
    if not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows ({rows!r}) must be an int >= 0")
    return max(1, -(-rows // CAPACITY_ALIGN_ROWS)) * CAPACITY_ALIGN_ROWS


@dataclass(frozen=True)
class SymmMemTokenConfig:
    """What sizes one token exchange (frozen: it keys the manager's handle cache).

    max_num_tokens: most tokens a rank dispatches.  topk: routes per token.
    num_local_experts: El.  dispatch_row_bytes: B.  combine_row_bytes: Bc.
    major_align: all_to_all_vdev_2d's per-expert alignment of the received rows (>= 1).
    """

    max_num_tokens: int
    topk: int
    num_local_experts: int
    dispatch_row_bytes: int
    combine_row_bytes: int
    major_align: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_tokens", "topk", "num_local_experts", "dispatch_row_bytes", "combine_row_bytes",
                     "major_align"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SymmMemTokenConfig.{name} ({v!r}) must be an int >= 1")

    def send_rows(self) -> int:
        """Rows one rank sends at most: one per route."""
        return self.max_num_tokens * self.topk

    def recv_rows(self, world_size: int) -> int:
        """Rows one rank may receive: every rank's tokens, each with at most min(topk, El) routes held
        here, plus per local expert the alignment the op adds (an empty expert still gets major_align)."""
        per_token = min(self.topk, self.num_local_experts)
        return world_size * self.max_num_tokens * per_token + self.num_local_experts * self.major_align

    def send_capacity(self) -> int:
        return aligned_capacity(self.send_rows())

    def recv_capacity(self, world_size: int) -> int:
        return aligned_capacity(self.recv_rows(world_size))


# ---- the backend seam -------------------------------------------------------------------------

class SymmMemBackend(Protocol):
    """The three symmetric-memory calls the manager makes."""

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A symmetric tensor (collective: every rank allocates the same shape in the same order)."""

    def all_to_all_2d(self, input: torch.Tensor, out: torch.Tensor, in_splits: torch.Tensor,
                      out_splits_offsets: torch.Tensor, group_name: str, major_align: int) -> None: ...

    def all_to_all_2d_offset(self, input: torch.Tensor, out: torch.Tensor, in_splits_offsets: torch.Tensor,
                             out_splits_offsets: torch.Tensor, group_name: str) -> None: ...


class TorchSymmMemBackend:
    """torch.distributed._symmetric_memory on NVSHMEM; allocation rendezvous with the group."""

    def __init__(self, group_name: str, device: torch.device) -> None:
        reason = runtime_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        import torch.distributed._symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        self.group_name = group_name
        get_backend = getattr(symm_mem, "get_backend", None)
        current = get_backend(device) if get_backend is not None else None
        if current != SYMM_MEM_BACKEND_NAME:
            # torch reports its default (CUDA) until a backend is chosen; the choice is only
            # possible before the first symmetric allocation in this process.
            try:
                symm_mem.set_backend(SYMM_MEM_BACKEND_NAME)
            except Exception as exc:  # noqa: BLE001 - re-raised with what to do
                raise RuntimeError(
                    f"symmetric memory backend on {device} is {current}; the 2-D all-to-all ops need "
                    f"{SYMM_MEM_BACKEND_NAME}, which must be set before the first symmetric allocation ({exc})"
                ) from exc
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # required before torch 2.9, a deprecated no-op after
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(group_name)

    def allocate(self, shape, dtype, device):
        t = self._symm_mem.empty(tuple(shape), dtype=dtype, device=device)
        self._symm_mem.rendezvous(t, self.group_name)
        return t

    def all_to_all_2d(self, input, out, in_splits, out_splits_offsets, group_name, major_align):
        torch.ops.symm_mem.all_to_all_vdev_2d(input, out, in_splits, out_splits_offsets, group_name,
                                              major_align=major_align)

    def all_to_all_2d_offset(self, input, out, in_splits_offsets, out_splits_offsets, group_name):
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(input, out, in_splits_offsets, out_splits_offsets, group_name)


# ---- the buffer cache -------------------------------------------------------------------------

class SymmMemBufferCache:
    """Symmetric buffers keyed by (group name, buffer name, row shape, dtype), dim 0 the capacity.

    reserve(...) grows a buffer to at least `rows` rows (aligned); get(...) returns the current one
    and refuses to grow (growth must happen at construction, the same on every rank)."""

    def __init__(self, backend: SymmMemBackend, group_name: str, device: torch.device) -> None:
        self.backend = backend
        self.group_name = group_name
        self.device = device
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.num_allocations = 0

    def _key(self, name: str, row_shape: tuple[int, ...], dtype: torch.dtype) -> tuple:
        return (self.group_name, name, tuple(row_shape), dtype)

    def reserve(self, name: str, row_shape: tuple[int, ...], dtype: torch.dtype, rows: int) -> int:
        """Make the buffer hold >= rows rows; returns its capacity. Growing frees the old buffer first."""
        key = self._key(name, row_shape, dtype)
        old = self._buffers.get(key)
        need = aligned_capacity(rows)
        if old is not None and old.size(0) >= need:
            return old.size(0)
        if old is not None:
            del self._buffers[key]
            del old
        self._buffers[key] = self.backend.allocate((need, *row_shape), dtype, self.device)
        self.num_allocations += 1
        return need

    def reserve_fixed(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """A buffer of exactly `shape` (splits and offsets), allocated once."""
        key = self._key(name, shape, dtype)
        if key not in self._buffers:
            self._buffers[key] = self.backend.allocate(tuple(shape), dtype, self.device)
            self.num_allocations += 1

    def get(self, name: str, row_shape: tuple[int, ...], dtype: torch.dtype, rows: Optional[int] = None) -> torch.Tensor:
        """The whole buffer (capacity rows); `rows`, when given, must fit (reserve grows, get never does)."""
        key = self._key(name, row_shape, dtype)
        buf = self._buffers.get(key)
        if buf is None:
            raise KeyError(f"symmetric buffer {name!r} {tuple(row_shape)} {dtype} of group {self.group_name!r} "
                           f"was not reserved (or was destroyed)")
        if rows is not None and rows > buf.size(0):
            raise ValueError(f"symmetric buffer {name!r} holds {buf.size(0)} rows; {rows} were asked for")
        return buf

    def get_fixed(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.get(name, shape, dtype)

    def capacity(self, name: str, row_shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return self.get(name, row_shape, dtype).size(0)

    def __len__(self) -> int:
        return len(self._buffers)

    def clear(self) -> None:
        self._buffers.clear()


class SymmMemTokenHandle:
    """A reserved token exchange: its config and capacities (buffers are looked up at use time, so a
    later, larger layer's growth is seen by every handle)."""

    def __init__(self, config: SymmMemTokenConfig, send_capacity: int, recv_capacity: int) -> None:
        self.config = config
        self.send_capacity = send_capacity
        self.recv_capacity = recv_capacity


# ---- the manager ------------------------------------------------------------------------------

_SEND, _RECV, _IN_SPLITS, _OUT_SO = "dispatch_send", "dispatch_recv", "dispatch_in_splits", "dispatch_out_splits_offsets"
_CIN, _COUT, _COUT_SO = "combine_in", "combine_out", "combine_out_splits_offsets"
LAYOUT_SLOTS = 2  # dispatch layouts kept at once, for as many exchanges between dispatch and combine


def _layout_name(slot: int) -> str:
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < LAYOUT_SLOTS:
        raise ValueError(f"slot ({slot!r}) must be an int in [0, {LAYOUT_SLOTS})")
    return f"{_OUT_SO}.{slot}"


class SymmMemManager(NcclAllToAllManager):
    """2-D token all-to-all on symmetric memory; see the module docstring.

    group: an initialized NCCL process group of 2 to MAX_WORLD_SIZE ranks.  device: cuda:<current>.
    backend: the symmetric-memory calls (TorchSymmMemBackend over the group when None).
    """

    backend_name = "symm_mem"

    def __init__(self, group: Any, device: Optional[torch.device] = None,
                 backend: Optional[SymmMemBackend] = None) -> None:
        super().__init__(group, device)
        error = world_size_error(self.world_size)
        if error is not None:
            raise ValueError(f"{type(self).__name__}: {error}")
        self.group_name = str(group.group_name)
        self.symm_backend = backend if backend is not None else TorchSymmMemBackend(self.group_name, self.device)
        self.buffers = SymmMemBufferCache(self.symm_backend, self.group_name, self.device)
        self._token_handles: dict[SymmMemTokenConfig, SymmMemTokenHandle] = {}

    # ---- reservation ----------------------------------------------------------------------------
    def token_handle(self, config: SymmMemTokenConfig) -> SymmMemTokenHandle:
        """Reserve (grow) the shared buffers `config` needs; one handle per distinct config."""
        self._check_alive()
        handle = self._token_handles.get(config)
        if handle is not None:
            return handle
        error = local_experts_error(config.num_local_experts)
        if error is not None:
            raise ValueError(error)
        W, El, u8, i64 = self.world_size, config.num_local_experts, torch.uint8, torch.int64
        B, Bc = config.dispatch_row_bytes, config.combine_row_bytes
        cs = self.buffers.reserve(_SEND, (B,), u8, config.send_rows())
        cr = self.buffers.reserve(_RECV, (B,), u8, config.recv_rows(W))
        self.buffers.reserve(_CIN, (Bc,), u8, config.recv_rows(W))
        self.buffers.reserve(_COUT, (Bc,), u8, config.send_rows())
        self.buffers.reserve_fixed(_IN_SPLITS, (W * El,), i64)
        for slot in range(LAYOUT_SLOTS):
            self.buffers.reserve_fixed(_layout_name(slot), (2, W * El), i64)
        self.buffers.reserve_fixed(_COUT_SO, (2, W * El), i64)
        handle = SymmMemTokenHandle(config, cs, cr)
        self._token_handles[config] = handle
        return handle

    # ---- the exchange ---------------------------------------------------------------------------
    def dispatch_2d(self, handle: SymmMemTokenHandle, rows_SB: torch.Tensor,
                    splits_WEl: torch.Tensor, slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """rows_SB (S, B) uint8 sorted by (destination rank, its local expert); splits_WEl (W*El,) int64
        the rows per (rank, local expert); slot: where the layout is kept for the combine_2d of this exchange.
        Returns (recv (Cr, B) uint8, valid until the next dispatch; splits_offsets (2, W*El) int64): row 0 the
        rows received per (local expert, source rank), row 1 where they start in recv."""
        self._check_alive()
        cfg, W = handle.config, self.world_size
        El, B = cfg.num_local_experts, cfg.dispatch_row_bytes
        S = rows_SB.size(0)
        if rows_SB.dtype != torch.uint8 or rows_SB.dim() != 2 or rows_SB.size(1) != B:
            raise ValueError(f"rows must be (S, {B}) uint8, got {tuple(rows_SB.shape)} {rows_SB.dtype}")
        if splits_WEl.numel() != W * El:
            raise ValueError(f"splits has {splits_WEl.numel()} entries; it must have W * El ({W * El})")
        send = self.buffers.get(_SEND, (B,), torch.uint8, S)
        recv = self.buffers.get(_RECV, (B,), torch.uint8, handle.recv_capacity)
        in_splits = self.buffers.get_fixed(_IN_SPLITS, (W * El,), torch.int64)
        out_so = self.buffers.get_fixed(_layout_name(slot), (2, W * El), torch.int64)
        send[:S].copy_(rows_SB)
        in_splits.copy_(splits_WEl.reshape(-1))
        self.symm_backend.all_to_all_2d(send, recv, in_splits, out_so, self.group_name, cfg.major_align)
        return recv, out_so

    def combine_input(self, handle: SymmMemTokenHandle) -> torch.Tensor:
        """The (Cr, Bc) uint8 buffer to fill, at the dispatch's receive positions, before combine_2d."""
        cfg = handle.config
        return self.buffers.get(_CIN, (cfg.combine_row_bytes,), torch.uint8, handle.recv_capacity)

    def combine_2d(self, handle: SymmMemTokenHandle, num_send: int, slot: int = 0) -> torch.Tensor:
        """Send combine_input's rows back along the layout of the latest dispatch through `slot`. Returns
        (num_send, Bc) uint8 in the dispatch's send order, valid until the next combine."""
        self._check_alive()
        cfg, W = handle.config, self.world_size
        El, Bc = cfg.num_local_experts, cfg.combine_row_bytes
        cin = self.combine_input(handle)
        cout = self.buffers.get(_COUT, (Bc,), torch.uint8, num_send)
        in_so = self.buffers.get_fixed(_layout_name(slot), (2, W * El), torch.int64)
        out_so = self.buffers.get_fixed(_COUT_SO, (2, W * El), torch.int64)
        self.symm_backend.all_to_all_2d_offset(cin, cout, in_so, out_so, self.group_name)
        return cout[:num_send]

    # ---- lifecycle ------------------------------------------------------------------------------
    def destroy_symm_mem_buffers(self) -> None:
        """Release every symmetric buffer and reservation (layers built before must be rebuilt)."""
        self.buffers.clear()
        self._token_handles.clear()

    def destroy(self) -> None:
        if self.destroyed:
            return
        self.destroy_symm_mem_buffers()
        super().destroy()


def destroy_symm_mem_buffers(manager: SymmMemManager) -> None:
    """Release every symmetric buffer `manager` holds (ParallelContext.destroy() does this for the
    managers a context made)."""
    if not isinstance(manager, SymmMemManager):
        raise TypeError(f"destroy_symm_mem_buffers takes a SymmMemManager, got {type(manager).__name__}")
    manager.destroy_symm_mem_buffers()
