"""moe_modular.profiler_scope.phase: a named range while a profiler records, nothing otherwise."""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from moe_modular.profiler_scope import phase


def _names(prof) -> set[str]:
    return {e.name for e in prof.events()}


def test_phase_records_only_under_a_profiler():
    x = torch.randn(8, 8)
    with phase("outside_any_profiler"):  # no profiler: a no-op context, the body still runs
        y = x @ x
    assert torch.equal(y, x @ x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with phase("moe_phase_under_test"):
            x @ x
    names = _names(prof)
    assert "moe_phase_under_test" in names
    assert "outside_any_profiler" not in names
