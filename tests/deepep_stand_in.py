"""A CPU stand-in for deep_ep (test-only): the V1 `Buffer` interface the DeepEP classes call, with
the documented semantics, computed over gloo with all_gather_object. It checks the arguments the
real kernels would reject (row alignment, dtypes, capacities) so a PF that passes here hands
DeepEP what it accepts; it does not model DeepEP's speed or its buffer layout.

make_stand_in(...) returns a fresh module object whose `log` list records Buffer construction and
destruction, so tests can count them. Like DeepEP, a low-latency Buffer stands for the process's NVSHMEM: a
second one while the first is alive is refused, and its queue-pair depth is NVSHMEM_QP_DEPTH as the
environment sets it when the Buffer is built.

Shape legend: W ranks, T tokens on a rank, k topk, El local experts, Tm max tokens per rank,
B = Tm * W slots, Kp / Kl padded hidden sizes.
"""
from __future__ import annotations

import os
import types
import weakref
from typing import Any

import torch
import torch.distributed as dist

from all2all.deepep import (
    HT_ROW_ALIGN_BYTES,
    LL_DEFAULT_QP_DEPTH,
    LL_HIDDEN_SIZES,
    LL_MAX_TOPK,
    LL_MIN_EXPERTS,
    LL_SCALE_GROUP,
    LL_TOKEN_MULTIPLE,
)
from moe_modular.quant import QuantConfig, quantize_activations

FP8 = torch.float8_e4m3fn


def _wire(t: Any) -> Any:
    """fp8 tensors travel through pickling as uint8 views."""
    if isinstance(t, torch.Tensor) and t.dtype == FP8:
        return ("fp8", t.contiguous().view(torch.uint8).clone())
    return t


def _unwire(t: Any) -> Any:
    if isinstance(t, tuple) and len(t) == 2 and t[0] == "fp8":
        return t[1].view(FP8)
    return t


def _gather(obj: Any, group: Any) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def quantize_1x128(x_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 with one float32 scale per 1 x 128 group (scale = amax / 448, multiplied to dequantize):
    the project's torch group quantization, the oracle's."""
    return quantize_activations(x_NK, QuantConfig.fp8_block((LL_SCALE_GROUP, LL_SCALE_GROUP)), use_kernel=False)


def make_stand_in(has_use_fp8: bool = True, explicit_destroy: bool = True) -> types.ModuleType:
    """has_use_fp8=False models the first releases (low_latency_dispatch always casts to fp8);
    explicit_destroy=False models builds whose Buffer has no destroy()."""
    mod = types.ModuleType("deep_ep")
    mod.log = []
    live_ll = weakref.WeakSet()  # low-latency Buffers not yet destroyed (NVSHMEM initialised once per process)

    class Config:
        def __init__(self, num_sms: int, nvl_chunk: int, nvl_recv: int, rdma_chunk: int, rdma_recv: int) -> None:
            self.num_sms, self.nvl_chunk, self.nvl_recv = num_sms, nvl_chunk, nvl_recv
            self.rdma_chunk, self.rdma_recv = rdma_chunk, rdma_recv

        def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
            return (self.num_sms // 2) * min(num_ranks, 8) * self.nvl_recv * hidden_bytes

        def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
            return (self.num_sms // 2) * (num_ranks // 8) * self.rdma_recv * hidden_bytes * 2

    class Buffer:
        num_sms = 20

        def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                     num_qps_per_rank: int = 1, allow_nvlink_for_low_latency_mode: bool = True,
                     explicitly_destroy: bool = False) -> None:
            self.group = group
            self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
            self.low_latency_mode, self.num_qps_per_rank = low_latency_mode, num_qps_per_rank
            self.explicitly_destroy = explicitly_destroy
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
            if low_latency_mode:
                if len(live_ll):
                    raise RuntimeError("NVSHMEM is already initialised by another low-latency Buffer of this process")
                live_ll.add(self)
                self.qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", LL_DEFAULT_QP_DEPTH))
            mod.log.append(("init", id(self), num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                            explicitly_destroy))

        @staticmethod
        def get_dispatch_config(num_ranks: int) -> Config:
            return Config(Buffer.num_sms, 6, 256, 6, 128)

        @staticmethod
        def get_combine_config(num_ranks: int) -> Config:
            return Config(Buffer.num_sms, 6, 320, 6, 160)

        @staticmethod
        def get_low_latency_rdma_size_hint(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
            return 2 * max_tokens * num_ranks * (hidden * 2 + 64) * 2

        # ---- high throughput ------------------------------------------------------------------
        def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                                allocate_on_comm_stream=False):
            assert topk_idx.dtype == torch.int64 and topk_idx.dim() == 2
            W, El = self.world_size, num_experts // self.world_size
            owner = torch.where(topk_idx >= 0, topk_idx // El, torch.full_like(topk_idx, -1))
            in_rank = torch.stack([(owner == r).any(dim=1) for r in range(W)], dim=1)
            per_rank = in_rank.sum(dim=0).to(torch.int32)
            valid = topk_idx[topk_idx >= 0]
            per_expert = torch.bincount(valid, minlength=num_experts).to(torch.int32)
            self._num_experts = num_experts
            return per_rank, None, per_expert, in_rank, None

        def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                     is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                     expert_alignment=1, config=None, previous_event=None, async_finish=False,
                     allocate_on_comm_stream=False):
            assert config is not None and is_token_in_rank is not None and topk_idx.dtype == torch.int64
            xs = x if isinstance(x, tuple) else (x,)
            data = xs[0]
            assert data.is_contiguous() and (data.size(1) * data.element_size()) % HT_ROW_ALIGN_BYTES == 0, \
                "rows must be whole 512-byte units"
            if len(xs) == 2:
                assert data.element_size() == 1 and xs[1].dtype == torch.float32 and xs[1].size(0) == data.size(0)
            assert topk_weights.dtype == torch.float32
            me, El = self.rank, self._num_experts // self.world_size
            every = _gather(([_wire(t) for t in xs], topk_idx, topk_weights), self.group)
            rows, scales, ids, weights, pairs = [], [], [], [], []
            for src, (parts, idx, w) in enumerate(every):
                parts = [_unwire(p) for p in parts]
                for t in range(idx.size(0)):
                    mine = (idx[t] >= me * El) & (idx[t] < (me + 1) * El)
                    if not bool(mine.any()):
                        continue
                    rows.append(parts[0][t])
                    if len(parts) == 2:
                        scales.append(parts[1][t])
                    ids.append(torch.where(mine, idx[t] - me * El, torch.full_like(idx[t], -1)))
                    weights.append(w[t])  # DeepEP's weights for routes held elsewhere are not to be trusted
                    pairs.append((src, t))
            K, k = data.size(1), topk_idx.size(1)
            recv_x = torch.stack(rows) if rows else torch.empty((0, K), dtype=data.dtype)
            recv_ids = torch.stack(ids) if ids else torch.empty((0, k), dtype=torch.int64)
            recv_w = torch.stack(weights) if weights else torch.empty((0, k), dtype=torch.float32)
            per_expert = [int((recv_ids == e).sum()) for e in range(El)]
            if len(xs) == 2:
                G = xs[1].size(1)
                recv_x = (recv_x, torch.stack(scales) if scales else torch.empty((0, G), dtype=torch.float32))
            return recv_x, recv_ids, recv_w, per_expert, (pairs, data.size(0)), None

        def combine(self, x, handle, topk_weights=None, config=None, previous_event=None, async_finish=False,
                    allocate_on_comm_stream=False):
            assert config is not None
            assert x.dtype == torch.bfloat16 and x.is_contiguous() and (x.size(1) * 2) % HT_ROW_ALIGN_BYTES == 0
            pairs, T = handle
            assert x.size(0) == len(pairs)
            every = _gather((pairs, x), self.group)
            out = torch.zeros((T, x.size(1)), dtype=torch.float32)
            for src_pairs, rows in every:
                for (src, t), row in zip(src_pairs, rows):
                    if src == self.rank:
                        out[t] += row.float()
            return out.to(torch.bfloat16), None, None

        # ---- low latency ----------------------------------------------------------------------
        def _ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                         return_recv_hook):
            assert self.low_latency_mode
            assert x.dtype == torch.bfloat16 and x.is_contiguous() and x.size(1) in LL_HIDDEN_SIZES
            assert topk_idx.dtype == torch.int64 and topk_idx.size(1) <= LL_MAX_TOPK
            Tm = num_max_dispatch_tokens_per_rank
            assert x.size(0) <= Tm
            W, me, El, Kl = self.world_size, self.rank, num_experts // self.world_size, x.size(1)
            assert (W * Tm) % LL_TOKEN_MULTIPLE == 0, "TMA requires the number of tokens to be multiple of 4"
            assert num_experts % W == 0 and num_experts >= LL_MIN_EXPERTS, "the dispatch kernel needs 2+ experts"
            assert self.qp_depth >= (Tm + 1) * 2, "NVSHMEM_QP_DEPTH too small for this many tokens per rank"
            assert not use_fp8 or Kl % 512 == 0
            B = Tm * W
            every = _gather((x, topk_idx, Tm), self.group)
            assert all(tm == Tm for _, _, tm in every), "max tokens per rank must match on every rank"
            slots = torch.full((El, B, Kl), float("nan"), dtype=torch.bfloat16)
            src_info = [[] for _ in range(El)]
            for e in range(El):
                for src, (xs, idx, _) in enumerate(every):
                    for t in range(idx.size(0)):
                        if bool((idx[t] == me * El + e).any()):
                            slots[e, len(src_info[e])] = xs[t]
                            src_info[e].append((src, t))
            count = torch.tensor([len(s) for s in src_info], dtype=torch.int32)
            if use_fp8:
                q, s = quantize_1x128(slots.reshape(El * B, Kl).nan_to_num(0.0))
                ready = (q.view(El, B, Kl), s.view(El, B, Kl // LL_SCALE_GROUP))
                out = (torch.full((El, B, Kl), float("nan")).to(FP8),
                       torch.full((El, Kl // LL_SCALE_GROUP, B), float("nan")).transpose(1, 2))  # column-major
            else:
                ready = (slots,)
                out = (torch.full((El, B, Kl), float("nan"), dtype=torch.bfloat16),)

            def hook() -> None:
                for dst, src in zip(out, ready):
                    dst.copy_(src)

            if not return_recv_hook:
                hook()
            handle = (src_info, Tm, num_experts, x.size(0))
            return (out if use_fp8 else out[0]), count, handle, None, hook

        def low_latency_combine(self, x, topk_idx, topk_weights, handle, async_finish=False,
                                return_recv_hook=False, zero_copy=False):
            src_info, Tm, num_experts, T = handle
            W, me, El = self.world_size, self.rank, num_experts // self.world_size
            assert x.dtype == torch.bfloat16 and tuple(x.shape[:2]) == (El, Tm * W) and x.size(2) in LL_HIDDEN_SIZES
            assert topk_idx.shape == topk_weights.shape and topk_idx.size(0) == T
            every = _gather((x, src_info), self.group)
            out = torch.zeros((T, x.size(2)), dtype=torch.float32)
            for r, (xr, info) in enumerate(every):
                for e in range(El):
                    for slot, (src, t) in enumerate(info[e]):
                        if src != me:
                            continue
                        hit = topk_idx[t] == r * El + e
                        out[t] += topk_weights[t][hit].sum() * xr[e, slot].float()
            return out.to(torch.bfloat16), None, (lambda: None)

        def destroy(self) -> None:
            assert self.explicitly_destroy, "destroy() is for buffers built with explicitly_destroy=True"
            live_ll.discard(self)
            mod.log.append(("destroy", id(self)))

    if has_use_fp8:
        def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                 cumulative_local_expert_recv_stats=None, use_fp8=True, round_scale=False,
                                 use_ue8m0=False, async_finish=False, return_recv_hook=False):
            return self._ll_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                                     return_recv_hook)
    else:
        def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                 async_finish=False, return_recv_hook=False):
            return self._ll_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, True,
                                     return_recv_hook)
    Buffer.low_latency_dispatch = low_latency_dispatch
    if not explicit_destroy:
        del Buffer.destroy
        original_init = Buffer.__init__

        def init_without_explicit(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                                  num_qps_per_rank=1, allow_nvlink_for_low_latency_mode=True):
            original_init(self, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                          allow_nvlink_for_low_latency_mode)
        Buffer.__init__ = init_without_explicit
    mod.Buffer = Buffer
    mod.Config = Config
    return mod
