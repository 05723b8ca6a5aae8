"""The CLI's default tour of the combinations matrix covers what the whole matrix covers, in fewer cells."""
from __future__ import annotations

import pytest

from moe_modular.config import Activation, ExpertPlacement
from moe_modular.testing.matrix import matrix_configs, tour
from moe_modular.testing.mk_objects import MK_ALL_PREPARE_FINALIZE_TYPES, MK_FUSED_EXPERT_TYPES, MK_QUANT_CONFIGS
from moe_modular.testing.cli import CPU_MS as PYTEST_MS, CPU_SHAPE as PYTEST_SHAPE, CPU_TOPKS as PYTEST_TOPKS, parse_request


def _cells(world_sizes):
    return matrix_configs(MK_ALL_PREPARE_FINALIZE_TYPES, MK_FUSED_EXPERT_TYPES, MK_QUANT_CONFIGS, world_sizes,
                          Ms=PYTEST_MS, topks=PYTEST_TOPKS, K=PYTEST_SHAPE["K"], N=PYTEST_SHAPE["N"],
                          E=PYTEST_SHAPE["E"], activation=Activation.SILU, placement=ExpertPlacement.LINEAR)


def test_tour_covers_every_pf_experts_class_pair_and_scheme_of_the_valid_matrix():
    for world_sizes in ((1,), (1, 2)):
        cells = _cells(world_sizes)
        valid = [c for c, ok, _ in cells if ok]
        chosen = tour(cells)
        assert 0 < len(chosen) < len(valid) / 2
        assert all(c in valid for c in chosen) and len(set(chosen)) == len(chosen)
        pairs = {(c.prepare_finalize_type, c.fused_experts_type, c.world_size) for c in valid}
        assert {(c.prepare_finalize_type, c.fused_experts_type, c.world_size) for c in chosen} == pairs
        assert {(c.dtype, c.quant) for c in chosen} == {(c.dtype, c.quant) for c in valid}


def test_tour_of_nothing_is_nothing():
    assert tour([(c, False, "invalid") for c, _, _ in _cells((1,))]) == []


def test_full_is_for_the_matrix_not_a_pair():
    assert parse_request(["--full"]).full
    with pytest.raises(ValueError, match="--full is for the matrix"):
        parse_request(["--full", "--pf-type", "MoEPrepareAndFinalizeNoEP", "--experts-type", "TorchExperts"])
