"""GroupedMMExperts: Standard-format experts on torch's grouped GEMMs with a plain torch permute.

Shape legend: T tokens, k topk, R = T * k routes, K hidden, N2 = w1 rows (2 * N), N intermediate,
El local experts, E global experts.

One forward, torch ops only, no host sync (CUDA-graph capturable at fixed T):
  1. local expert of each route (through expert_map) and a stable sort of the routes by it; routes
     not held here join the last expert's group, so every row the GEMMs write is finite (no
     uninitialized tail), and they get a zero weight in step 6;
  2. offsets: the int32 end row of each local expert's group (searchsorted over the sorted keys);
  3. gather the routes' token rows in expert order; GEMM1 (R, N2) = a @ w1[e].T grouped;
  4. act(gate) * up (fp8: re-quantized per row);
  5. GEMM2 (R, K) = intermediate @ w2[e].T grouped;
  6. unpermute and reduce: out[t] = sum_j w[t, j] * y[route (t, j)] as one batched (1 x k) @ (k x K)
     product with float32 accumulation, written straight into the output.

bf16 runs on torch._grouped_mm; fp8 with per-token activation scales and per-channel weight scales
on torch._scaled_grouped_mm (row-wise scales: (R,) for the rows of A, (El, No) for the columns of
each expert's B), both CUTLASS kernels on sm90 / sm100.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from moe_modular.config import Activation, MoEConfig, dtype_name
from moe_modular.interfaces import ActivationFormat, ExpertTokensMetadata, FusedMoEExpertsModular
from moe_modular.activation import act_and_mul_torch
from moe_modular.quant import ActivationQuant, QuantConfig, QuantDtype, WeightQuant, quantize_activations
from moe_modular.routing import local_route_ids
from moe_modular.weight_and_reduce import TopKWeightAndReduceNoOp

# Every row handed to the grouped GEMMs (A rows, the K-major weight columns, the outputs) must
# start on a 16-byte boundary.
_ROW_ALIGN_BYTES = 16
# CUDA compute capabilities (major) with torch's CUTLASS grouped-GEMM kernels; elsewhere torch falls
# back to a per-group loop that copies the offsets to the host (a sync per call).
_CUTLASS_MAJORS = (9, 10)
_PER_TOKEN_FP8 = (QuantDtype.FP8_E4M3, ActivationQuant.PER_TOKEN, WeightQuant.PER_CHANNEL)


def _scheme_op(q: QuantConfig) -> Optional[str]:
    """The torch op serving scheme q, or None when neither grouped GEMM can express it."""
    if not q.is_quantized:
        return "_grouped_mm"
    if (q.quant_dtype, q.activation, q.weight) == _PER_TOKEN_FP8:
        return "_scaled_grouped_mm"
    return None


def _has_kernel(op: str, dispatch_key: str) -> bool:
    name = f"aten::{op}"
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return bool(has(name, dispatch_key) or (dispatch_key == "CPU" and has(name, "CompositeExplicitAutograd")))


class GroupedMMExperts(FusedMoEExpertsModular):
    """bf16 unquantized, or fp8 per-token activations with per-channel weights (bf16 activations);
    SiLU, GELU and swiglu-oai; expert maps. Weights and reduces the routes itself: the output is
    the final (T, K) and the PF has nothing left to reduce (TopKWeightAndReduceNoOp)."""

    @classmethod
    def supports(cls, moe: MoEConfig) -> tuple[bool, str]:
        q = moe.quant
        op = _scheme_op(q)
        if op is None:
            return False, (f"quant scheme {q.name} has no torch grouped GEMM (torch._scaled_grouped_mm takes "
                           f"row-wise scales only); allowed: unquantized, fp8-token")
        if not hasattr(torch, op):
            return False, f"torch {torch.__version__} has no torch.{op}"
        if moe.dtype != torch.bfloat16:
            return False, (f"dtype {dtype_name(moe.dtype)} is not supported: torch.{op} computes in and "
                           f"writes bfloat16 only; allowed: ['bfloat16']")
        item = 1 if q.is_quantized else 2
        align = _ROW_ALIGN_BYTES // item
        for field, v in (("hidden_dim", moe.hidden_dim), ("intermediate_dim", moe.intermediate_dim)):
            if v % align:
                return False, (f"{field} ({v}) must be a multiple of {align}: torch.{op} needs rows of "
                               f"{_ROW_ALIGN_BYTES}-byte multiples ({item}-byte elements)")
        if torch.cuda.is_available():
            if torch.version.hip:
                return False, f"torch.{op} is served by CUTLASS on NVIDIA GPUs; this torch is a ROCm build"
            major, minor = torch.cuda.get_device_capability()
            if major not in _CUTLASS_MAJORS:
                return False, (f"torch.{op} has CUTLASS kernels for compute capability 9.x / 10.x only; the GPU "
                               f"has {major}.{minor} (elsewhere torch loops over groups with a host sync)")
            if not _has_kernel(op, "CUDA"):
                return False, f"this torch build has no CUDA kernel for aten::{op}"
        elif not _has_kernel(op, "CPU"):
            return False, f"no CUDA device, and torch {torch.__version__} has no CPU kernel for aten::{op}"
        return True, ""

    @classmethod
    def activation_formats(cls) -> tuple[ActivationFormat, ActivationFormat]:
        return ActivationFormat.Standard, ActivationFormat.Standard

    def supports_expert_map(self) -> bool:
        return True

    def supports_chunking(self) -> bool:
        return True

    def workspace_shapes(self, M, N2, K, topk, global_num_experts, local_num_experts, expert_tokens_meta):
        """workspace13 holds the gathered token rows (R, K) in expert order, workspace2 the second
        GEMM's rows back in route order (R, K); the grouped GEMMs allocate their own outputs (torch
        has no out= form of them). Output (M, K), already weighted and reduced."""
        R = M * topk
        return (R, K), (R, K), (M, K), self.moe.dtype

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOp()

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: Activation,
        global_num_experts: int,
        expert_map: Optional[torch.Tensor],
        a1q_scale: Optional[torch.Tensor],
        a2_scale: Optional[torch.Tensor],
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: Optional[ExpertTokensMetadata],
        apply_router_weight_on_input: bool,
    ) -> None:
        """output (T, K) bf16; hidden_states (T, K) bf16, or fp8 e4m3 with a1q_scale (T, 1) float32;
        w1 (El, N2, K), w2 (El, K, N) bf16 or fp8 (scales (El, N2, 1) / (El, K, 1) in self.quant);
        topk_weights (T, k) float32; topk_ids (T, k) int: global ids mapped by expert_map (E,) int32,
        or local ids (-1 or any id outside [0, El) = not held here) when expert_map is None."""
        T, K = hidden_states.shape
        k = topk_ids.size(1)
        El, N2, _ = w1.shape
        R = T * k
        if T == 0:
            return
        dev = hidden_states.device
        fp8 = self.quant.config.is_quantized

        # 1. the local expert of each route; not held -> the last group (zero weight below).
        ids_R = local_route_ids(topk_ids.reshape(-1), expert_map, El)  # out of range: -1, not held
        held_R = ids_R >= 0
        key_R = torch.where(held_R, ids_R, El - 1)
        key_sorted_R, order_R = torch.sort(key_R, stable=True)
        # 2. end offsets: routes with a key below e + 1; the last group ends at R.
        bounds = torch.arange(1, El + 1, device=dev, dtype=key_sorted_R.dtype)
        offs_El = torch.searchsorted(key_sorted_R, bounds, out_int32=True)

        # 3. token rows in expert order, GEMM1.
        tok_R = torch.div(order_R, k, rounding_mode="floor")
        a_RK = self._gather_rows(hidden_states, tok_R, workspace13, R)
        if fp8:
            w1_scale = self.quant.w1_scale.reshape(El, N2).float()
            a_scale_R = a1q_scale.reshape(-1).float().index_select(0, tok_R)
            h_RN2 = torch._scaled_grouped_mm(a_RK, w1.transpose(-2, -1), a_scale_R, w1_scale, offs=offs_El,
                                             out_dtype=torch.bfloat16)
        else:
            h_RN2 = torch._grouped_mm(a_RK, w1.transpose(-2, -1), offs=offs_El)

        # 4. act(gate) * up; 5. GEMM2.
        if fp8:
            inter_q, inter_scale = quantize_activations(act_and_mul_torch(h_RN2, activation),
                                                        QuantConfig.fp8_per_token())
            w2_scale = self.quant.w2_scale.reshape(El, K).float()
            y_RK = torch._scaled_grouped_mm(inter_q, w2.transpose(-2, -1), inter_scale.reshape(-1), w2_scale,
                                            offs=offs_El, out_dtype=torch.bfloat16)
        else:
            y_RK = torch._grouped_mm(self._act_and_mul(h_RN2, activation), w2.transpose(-2, -1), offs=offs_El)

        # 6. back to route order, weighted sum of each token's k routes.
        pos_R = torch.empty_like(order_R).scatter_(0, order_R, torch.arange(R, device=dev))
        y_route = workspace2.reshape(-1)[: R * K].view(R, K)
        torch.index_select(y_RK, 0, pos_R, out=y_route)
        if apply_router_weight_on_input:
            w_Tk = held_R.view(T, k).to(output.dtype)
        else:
            w_Tk = torch.where(held_R.view(T, k), topk_weights.float(), 0.0).to(output.dtype)
        torch.bmm(w_Tk.unsqueeze(1), y_route.view(T, k, K), out=output.view(T, 1, K))

    def _gather_rows(self, x_TK: torch.Tensor, tok_R: torch.Tensor, ws: torch.Tensor, R: int) -> torch.Tensor:
        """x_TK[tok_R] into the front of workspace ws as a contiguous (R, K) tensor of x's dtype (rows
        are copied as bytes, so fp8 needs no fp8 index kernel)."""
        x_TK = x_TK.contiguous()
        K = x_TK.size(1)
        raw = ws.reshape(-1).view(torch.uint8)
        nbytes = R * K * x_TK.element_size()
        if raw.numel() < nbytes:
            raise ValueError(f"workspace13 holds {raw.numel()} bytes, the gathered rows need {nbytes}")
        dst = raw[:nbytes].view(R, K * x_TK.element_size())
        torch.index_select(x_TK.view(torch.uint8), 0, tok_R, out=dst)
        return dst.view(x_TK.dtype)

    @staticmethod
    def _act_and_mul(h_RN2: torch.Tensor, activation: Activation) -> torch.Tensor:
        """act(gate) * up in h's dtype (R, N); swiglu-oai through the float32 oracle."""
        if activation is Activation.SWIGLU_OAI:
            return act_and_mul_torch(h_RN2, activation).to(h_RN2.dtype)
        n = h_RN2.size(1) // 2
        gate, up = h_RN2[:, :n], h_RN2[:, n:]
        act = F.silu(gate) if activation is Activation.SILU else F.gelu(gate)
        return act.mul_(up)
