"""Routing: fused_topk and grouped_topk against a float64 plain-loop oracle, expert maps, error texts.

Shape legend: T tokens, K hidden, E experts, k topk, G expert groups.
"""
from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

from moe_modular.config import ExpertPlacement
from moe_modular.routing import (
    ScoringFunc,
    fused_topk,
    grouped_topk,
    local_expert_ids,
    make_expert_map,
)

# Scores are computed in float32 from logits of at most a few hundred experts: each weight is within
# a few float32 ulps of the exact value (softmax sums E terms, renormalization sums k). 64 ulps of
# slack, relative to values bounded by routed_scaling_factor.
F32_TOL = 64 * torch.finfo(torch.float32).eps
# Two candidates whose exact (float64) scores are closer than this may swap in float32: a near-tie.
TIE_MARGIN = 1e3 * torch.finfo(torch.float32).eps


def oracle_grouped_topk(logits_TE: torch.Tensor, topk: int, renormalize: bool, num_groups: int, topk_group: int,
                        scoring: str, scale: float, bias_E: Optional[torch.Tensor]):
    """Plain-loop float64 reference. Returns per row (ids set, {id: weight}, decision margin):
    the margin is the smallest gap between the last kept and the first dropped candidate, of groups
    and of experts, so a disagreement with the float32 result can be told apart from a near-tie."""
    rows = logits_TE.double().tolist()
    bias = [0.0] * logits_TE.size(1) if bias_E is None else bias_E.double().tolist()
    E = logits_TE.size(1)
    Eg = E // num_groups
    out = []
    for logits in rows:
        if scoring == "softmax":
            m = max(logits)
            exps = [math.exp(v - m) for v in logits]
            total = sum(exps)
            scores = [v / total for v in exps]
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) for v in logits]
        select = [scores[e] + bias[e] for e in range(E)]
        group_scores = []
        for g in range(num_groups):
            members = sorted((select[e] for e in range(g * Eg, (g + 1) * Eg)), reverse=True)
            group_scores.append(sum(members[:2]) if bias_E is not None else members[0])
        group_order = sorted(range(num_groups), key=lambda g: -group_scores[g])
        kept = group_order[:topk_group]
        margin = math.inf
        if topk_group < num_groups:
            margin = group_scores[group_order[topk_group - 1]] - group_scores[group_order[topk_group]]
        candidates = sorted((e for g in kept for e in range(g * Eg, (g + 1) * Eg)), key=lambda e: -select[e])
        chosen = candidates[:topk]
        if topk < len(candidates):
            margin = min(margin, select[candidates[topk - 1]] - select[candidates[topk]])
        weights = [scores[e] for e in chosen]
        if renormalize:
            s = sum(weights)
            weights = [w / s for w in weights]
        out.append((set(chosen), {e: w * scale for e, w in zip(chosen, weights)}, margin))
    return out


def assert_matches_oracle(weights_Tk, ids_Tk, reference, scale: float = 1.0):
    """Every row picks the oracle's experts (unless the oracle's decision is a near-tie) with
    weights equal to the oracle's within float32 tolerance."""
    assert weights_Tk.dtype == torch.float32 and not torch.isnan(weights_Tk).any()
    near_ties = 0
    for t, (chosen, ref_w, margin) in enumerate(reference):
        got = ids_Tk[t].tolist()
        assert len(set(got)) == len(got), f"row {t}: repeated expert in {got}"
        if set(got) != chosen:
            assert margin < TIE_MARGIN, f"row {t}: got {sorted(got)}, oracle {sorted(chosen)} (margin {margin:.3g})"
            near_ties += 1
            continue
        for e, w in zip(got, weights_Tk[t].tolist()):
            assert abs(w - ref_w[e]) <= F32_TOL * max(1.0, scale), f"row {t} expert {e}: {w} vs {ref_w[e]}"
    assert near_ties <= max(1, len(reference) // 100), f"{near_ties} near-ties in {len(reference)} rows"


# ---------------------------------------------------------------------------------------------
# fused_topk
# ---------------------------------------------------------------------------------------------

FUSED_CASES = [
    # (T, E, topk, renormalize, logits dtype): the edge each case covers
    (64, 8, 2, True, torch.float32),  # the common case
    (33, 13, 3, False, torch.float32),  # prime E, raw softmax weights
    (17, 7, 1, True, torch.float32),  # topk = 1: renormalized weight is exactly 1
    (9, 6, 6, False, torch.float32),  # topk = E: weights are the whole softmax, sum to 1
    (12, 257, 8, True, torch.bfloat16),  # large prime E, bf16 logits upcast before the softmax
    (1, 16, 4, True, torch.float16),  # one token, fp16 logits
    (0, 16, 4, True, torch.float32),  # no tokens on this rank
]


@pytest.mark.parametrize("T,E,topk,renormalize,dtype", FUSED_CASES, ids=lambda v: str(v))
def test_fused_topk_matches_oracle(T, E, topk, renormalize, dtype):
    g = torch.Generator().manual_seed(T * 1000 + E)
    hidden_TK = torch.randn((T, 32), generator=g).to(torch.bfloat16)
    logits_TE = (torch.randn((T, E), generator=g) * 2).to(dtype)
    weights_Tk, ids_Tk = fused_topk(hidden_TK, logits_TE, topk, renormalize)
    assert weights_Tk.shape == (T, topk) and ids_Tk.shape == (T, topk) and ids_Tk.dtype == torch.int32
    # Softmax over all experts is grouped routing with a single group.
    reference = oracle_grouped_topk(logits_TE, topk, renormalize, 1, 1, "softmax", 1.0, None)
    assert_matches_oracle(weights_Tk, ids_Tk, reference)
    if T:
        assert torch.all(weights_Tk[:, :-1] >= weights_Tk[:, 1:]), "weights not in descending order"
        if renormalize or topk == E:
            torch.testing.assert_close(weights_Tk.sum(-1), torch.ones(T), rtol=0, atol=F32_TOL)


def test_fused_topk_int64_indices():
    logits_TE = torch.randn(5, 10)
    w32, ids32 = fused_topk(torch.empty(5, 4), logits_TE, 3, True)
    w64, ids64 = fused_topk(torch.empty(5, 4), logits_TE, 3, True, indices_dtype=torch.int64)
    assert ids64.dtype == torch.int64 and torch.equal(ids64, ids32.long()) and torch.equal(w64, w32)


# ---------------------------------------------------------------------------------------------
# grouped_topk
# ---------------------------------------------------------------------------------------------

GROUPED_CASES = [
    # (T, E, G, topk_group, topk, renormalize, scoring, scale, bias): the edge each case covers
    (64, 64, 8, 4, 8, True, "sigmoid", 2.5, True),  # DeepSeek-V3 shape: sigmoid + correction bias, scaled
    (40, 32, 4, 2, 6, True, "softmax", 1.0, False),  # softmax, group score = best expert
    (40, 32, 4, 2, 6, False, "sigmoid", 1.0, False),  # sigmoid without bias, not renormalized
    (25, 24, 6, 3, 4, False, "softmax", 1.0, True),  # softmax + bias, raw (unrenormalized) weights
    (16, 16, 4, 1, 1, True, "sigmoid", 1.0, True),  # topk = 1 from a single kept group
    (16, 16, 4, 2, 8, True, "sigmoid", 1.0, True),  # topk = topk_group * experts per group: both groups whole
    (16, 12, 4, 4, 12, False, "softmax", 1.0, False),  # all groups kept, topk = E
    (20, 8, 8, 3, 3, True, "sigmoid", 1.0, True),  # one expert per group: group score is that expert's
    (1, 64, 8, 4, 8, True, "sigmoid", 2.5, True),  # one token
    (0, 64, 8, 4, 8, True, "sigmoid", 2.5, True),  # no tokens on this rank
]


@pytest.mark.parametrize("T,E,G,topk_group,topk,renormalize,scoring,scale,use_bias", GROUPED_CASES,
                         ids=lambda v: str(v))
def test_grouped_topk_matches_oracle(T, E, G, topk_group, topk, renormalize, scoring, scale, use_bias):
    g = torch.Generator().manual_seed(T * 10000 + E * 100 + topk)
    hidden_TK = torch.randn((T, 16), generator=g)
    logits_TE = torch.randn((T, E), generator=g) * 2
    # A bias comparable to the scores, so it really changes which experts and groups win.
    bias_E = torch.randn((E,), generator=g) * 0.3 if use_bias else None
    weights_Tk, ids_Tk = grouped_topk(hidden_TK, logits_TE, topk, renormalize, G, topk_group,
                                      scoring_func=ScoringFunc(scoring), routed_scaling_factor=scale,
                                      e_score_correction_bias=bias_E)
    assert weights_Tk.shape == (T, topk) and ids_Tk.shape == (T, topk) and ids_Tk.dtype == torch.int32
    reference = oracle_grouped_topk(logits_TE, topk, renormalize, G, topk_group, scoring, scale, bias_E)
    assert_matches_oracle(weights_Tk, ids_Tk, reference, scale)
    # Every chosen expert lies in at most topk_group distinct groups.
    for row in ids_Tk.tolist():
        assert len({e // (E // G) for e in row}) <= topk_group


def test_grouped_topk_bias_selects_but_does_not_weigh():
    """A large bias on one expert makes it win everywhere, yet its weight stays its own score."""
    T, E = 6, 16
    logits_TE = torch.randn(T, E)
    bias_E = torch.zeros(E)
    bias_E[11] = 10.0
    w, ids = grouped_topk(torch.empty(T, 4), logits_TE, 2, False, 4, 1, ScoringFunc.SIGMOID,
                          e_score_correction_bias=bias_E)
    assert torch.all(ids[:, 0] == 11)
    torch.testing.assert_close(w[:, 0], torch.sigmoid(logits_TE[:, 11]), rtol=0, atol=F32_TOL)
    # Only experts of group 2 (ids 8..11) are eligible: the single kept group is the biased one.
    assert torch.all((ids >= 8) & (ids < 12))


def test_grouped_topk_single_group_equals_fused_topk():
    logits_TE = torch.randn(30, 20)
    hidden = torch.empty(30, 8)
    w_f, ids_f = fused_topk(hidden, logits_TE, 5, True)
    w_g, ids_g = grouped_topk(hidden, logits_TE, 5, True, 1, 1, "softmax")
    assert torch.equal(ids_f, ids_g)
    torch.testing.assert_close(w_f, w_g, rtol=0, atol=F32_TOL)


# ---------------------------------------------------------------------------------------------
# Expert maps
# ---------------------------------------------------------------------------------------------

MAP_CASES = [
    # (E, ep_size): the edge each case covers
    (8, 1),  # one rank holds everything: identity map
    (16, 4),  # several experts per rank
    (8, 8),  # one expert per rank
    (60, 6),  # experts per rank (10) not a power of two
]


@pytest.mark.parametrize("placement", list(ExpertPlacement), ids=lambda p: p.value)
@pytest.mark.parametrize("E,ep_size", MAP_CASES, ids=lambda v: str(v))
def test_expert_map_covers_each_expert_once(E, ep_size, placement):
    owner = torch.full((E,), -1, dtype=torch.int64)
    El = E // ep_size
    for rank in range(ep_size):
        emap = make_expert_map(E, ep_size, rank, placement)
        held = local_expert_ids(E, ep_size, rank, placement)
        assert emap.dtype == torch.int32 and emap.shape == (E,)
        assert held.shape == (El,)
        # Local ids are dense 0..El-1, and held[i] is the global expert at local index i.
        local = emap[emap >= 0]
        assert sorted(local.tolist()) == list(range(El))
        assert torch.all(emap[held] == torch.arange(El, dtype=torch.int32))
        assert int((emap == -1).sum()) == E - El
        assert torch.all(owner[held] == -1), f"rank {rank} holds experts already owned"
        owner[held] = rank
    assert torch.all(owner >= 0), "some expert has no owner"
    expected_owner = {
        ExpertPlacement.LINEAR: torch.arange(E) // El,
        ExpertPlacement.ROUND_ROBIN: torch.arange(E) % ep_size,
    }[placement]
    assert torch.equal(owner, expected_owner)


def test_expert_map_device_and_defaults():
    emap = make_expert_map(8, 2, 1, device=torch.device("cpu"))
    assert emap.tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    assert local_expert_ids(8, 2, 1, ExpertPlacement.ROUND_ROBIN).tolist() == [1, 3, 5, 7]


# ---------------------------------------------------------------------------------------------
# Error messages
# ---------------------------------------------------------------------------------------------

def _fused(T=4, E=8, topk=2, hidden_T=None, **kw):
    return fused_topk(torch.empty(T if hidden_T is None else hidden_T, 4), torch.randn(T, E), topk, True, **kw)


def _grouped(T=4, E=16, topk=2, G=4, topk_group=2, hidden_T=None, **kw):
    return grouped_topk(torch.empty(T if hidden_T is None else hidden_T, 4), torch.randn(T, E), topk, True, G,
                        topk_group, **kw)


ERROR_CASES = [
    # (call, expected message): the bad argument each case covers
    (lambda: _fused(topk=9), r"topk \(9\) must be an int in \[1, 8\] \(num_experts = 8\)"),
    (lambda: _fused(topk=0), r"topk \(0\) must be an int in \[1, 8\]"),
    (lambda: _fused(hidden_T=5), r"gating_output shape \(4, 8\) must be \(num_tokens, num_experts\) "
                                 r"with num_tokens = hidden_states.shape\[0\] \(5\)"),
    (lambda: _fused(indices_dtype=torch.float32),
     r"indices_dtype \(torch.float32\) must be one of \['torch.int32', 'torch.int64'\]"),
    (lambda: _grouped(G=5), r"num_expert_group \(5\) must divide num_experts \(16\)"),
    (lambda: _grouped(G=32), r"num_expert_group \(32\) must be an int in \[1, 16\] \(num_experts = 16\)"),
    (lambda: _grouped(topk_group=5), r"topk_group \(5\) must be an int in \[1, 4\] \(num_expert_group = 4\)"),
    (lambda: _grouped(topk=9), r"topk \(9\) must be an int in \[1, 8\] \(topk_group \* experts per group = 2 \* 4\)"),
    (lambda: _grouped(hidden_T=3), r"gating_output shape \(4, 16\) must be \(num_tokens, num_experts\)"),
    (lambda: _grouped(scoring_func="tanh"), r"scoring_func \('tanh'\) must be one of \['softmax', 'sigmoid'\]"),
    (lambda: _grouped(e_score_correction_bias=torch.zeros(15)),
     r"e_score_correction_bias shape \(15,\) must be \(num_experts,\) = \(16,\)"),
    (lambda: _grouped(routed_scaling_factor=0.0), r"routed_scaling_factor \(0.0\) must be a finite number > 0"),
    (lambda: make_expert_map(63, 8, 0), r"num_experts \(63\) must be divisible by ep_size \(8\)"),
    (lambda: local_expert_ids(64, 8, 8), r"ep_rank \(8\) must be an int in \[0, 7\] \(ep_size = 8\)"),
    (lambda: make_expert_map(64, 8, -1), r"ep_rank \(-1\) must be an int in \[0, 7\]"),
    (lambda: make_expert_map(64, 0, 0), r"ep_size \(0\) must be an int >= 1"),
    (lambda: make_expert_map(64, 8, 0, "linear"),
     r"placement \('linear'\) must be one of \['linear', 'round_robin'\]"),
]


@pytest.mark.parametrize("call,message", ERROR_CASES, ids=[m[:40] for _, m in ERROR_CASES])
def test_error_messages(call, message):
    with pytest.raises(ValueError, match=message):
        call()
