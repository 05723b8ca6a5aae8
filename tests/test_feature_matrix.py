"""The feature matrix: the committed docs/feature_matrix.{md,csv} cover every registered type and
scheme and agree with each other; the generator reports PASS, FAIL (with the error) and SKIP
(with the reason), and a cell that raises, hangs a peer or kills a rank fails only itself."""
from __future__ import annotations

import os
import re

import pytest
import torch

from moe_modular.config import dtype_name
from moe_modular.experts.naive_batched_experts import NaiveBatchedExperts
from moe_modular.experts.torch_experts import TorchExperts
from moe_modular.prepare_finalize.all_to_all_prepare_and_finalize import AllToAllPrepareAndFinalize
from moe_modular.prepare_finalize.batched import BatchedPrepareAndFinalize
from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
from moe_modular.quant import QuantConfig
from moe_modular.testing.matrix import matrix_configs
from moe_modular.testing.mk_objects import MK_ALL_PREPARE_FINALIZE_TYPES, MK_FUSED_EXPERT_TYPES, MK_QUANT_CONFIGS
from tools.make_feature_matrix import RESULTS, main, read_csv, run_cells, scheme_label, write_outputs

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
MD_PATH, CSV_PATH = os.path.join(DOCS, "feature_matrix.md"), os.path.join(DOCS, "feature_matrix.csv")


# ---- the committed files -----------------------------------------------------------------------

def _md_tables(text: str) -> dict[int, dict[tuple[str, str], dict[str, str]]]:
    """world size -> (pf, experts) -> scheme -> cell text, parsed from the Markdown."""
    tables: dict[int, dict] = {}
    ws, schemes = None, []
    for line in text.splitlines():
        m = re.match(r"## World size (\d+)$", line)
        if m:
            ws, schemes = int(m.group(1)), []
            tables[ws] = {}
            continue
        if ws is None or not line.startswith("|") or line.startswith("|---"):
            continue
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if cols[:2] == ["prepare/finalize", "experts"]:
            schemes = cols[2:]
        else:
            tables[ws][(cols[0], cols[1])] = dict(zip(schemes, cols[2:]))
    return tables


def test_committed_matrix_lists_every_registered_type_and_scheme():
    with open(MD_PATH) as f:
        md = f.read()
    records = read_csv(CSV_PATH)
    names = {t.__name__ for t in MK_ALL_PREPARE_FINALIZE_TYPES + MK_FUSED_EXPERT_TYPES}
    missing = sorted(n for n in names if n not in md)
    assert not missing, f"not in docs/feature_matrix.md (regenerate: python -m tools.make_feature_matrix): {missing}"
    world_sizes = sorted({r.world_size for r in records})
    assert 1 in world_sizes and len(world_sizes) >= 2, world_sizes
    have = {(r.world_size, r.prepare_finalize, r.experts, r.dtype, r.quant) for r in records}
    want = {(ws, pf.__name__, fe.__name__, dtype_name(d), q.name) for ws in world_sizes
            for pf in MK_ALL_PREPARE_FINALIZE_TYPES for fe in MK_FUSED_EXPERT_TYPES for d, q in MK_QUANT_CONFIGS}
    assert not (want - have), f"cells missing from docs/feature_matrix.csv: {sorted(want - have)[:5]}"
    assert len(records) == len(have), "a cell appears twice in the CSV"


def test_committed_csv_and_markdown_agree():
    with open(MD_PATH) as f:
        tables = _md_tables(f.read())
    records = read_csv(CSV_PATH)
    assert records and tables
    for r in records:
        assert r.result in RESULTS
        assert (r.detail == "") == (r.result == "PASS"), f"{r}: FAIL and SKIP carry a detail, PASS none"
        cell = tables[r.world_size][(r.prepare_finalize, r.experts)][r.scheme]
        assert cell.split()[0] == r.result, f"{r} but the Markdown says {cell!r}"
    assert any(r.result == "PASS" for r in records)


# ---- the generator ------------------------------------------------------------------------------

class ZeroingExperts(TorchExperts):
    """Wrong on purpose: writes zeros, so every case misses the oracle."""

    def apply(self, output, *args, **kwargs) -> None:
        output.zero_()


class RaisingOnRank1Experts(TorchExperts):
    """Raises on rank 1 only; rank 0 goes on into finalize's combine and waits for rank 1."""

    def apply(self, output, *args, **kwargs) -> None:
        if self.moe.parallel.ep_rank == 1:
            raise RuntimeError("injected failure on rank 1")
        super().apply(output, *args, **kwargs)


class ExitingOnRank1Experts(TorchExperts):
    """Rank 1's process dies (no traceback, no report), as after a segfault."""

    def apply(self, output, *args, **kwargs) -> None:
        if self.moe.parallel.ep_rank == 1:
            os._exit(3)
        super().apply(output, *args, **kwargs)


SMALL = dict(Ms=(1, 5), topks=(2,), K=64, N=32, E=4)  # one token; several tokens per expert
SCHEMES = [(torch.bfloat16, QuantConfig.unquantized()), (torch.bfloat16, QuantConfig.fp8_per_token())]


def test_generator_reports_pass_fail_and_skip(tmp_path):
    cells = matrix_configs([MoEPrepareAndFinalizeNoEP, BatchedPrepareAndFinalize],
                           [TorchExperts, NaiveBatchedExperts, ZeroingExperts], SCHEMES, (1,), **SMALL)
    records = run_cells(cells, progress=False)
    got = {(r.prepare_finalize, r.experts, r.quant): r for r in records}
    assert len(records) == len(cells) == 2 * 3 * 2
    for q in (q.name for _, q in SCHEMES):
        # The reference pairs pass, with their worst error below the format's tolerance.
        for pair in (("MoEPrepareAndFinalizeNoEP", "TorchExperts"), ("BatchedPrepareAndFinalize", "NaiveBatchedExperts")):
            r = got[pair + (q,)]
            assert r.result == "PASS" and r.detail == "" and r.max_error <= r.tolerance, r
        # Mismatched formats are skipped with the reason the classes give.
        for pair in (("MoEPrepareAndFinalizeNoEP", "NaiveBatchedExperts"), ("BatchedPrepareAndFinalize", "TorchExperts"),
                     ("BatchedPrepareAndFinalize", "ZeroingExperts")):
            r = got[pair + (q,)]
            assert r.result == "SKIP" and r.detail.startswith("format mismatch"), r
        # A wrong result fails with the cases that missed, their error and the tolerance.
        r = got[("MoEPrepareAndFinalizeNoEP", "ZeroingExperts", q)]
        assert r.result == "FAIL" and "M=1 topk=2 rank=0 err=1.00e+00 > tol=" in r.detail, r

    md_path, csv_path = write_outputs(records, str(tmp_path), "cmd", "shapes")
    assert read_csv(csv_path) == records
    with open(md_path) as f:
        tables = _md_tables(f.read())
    row = tables[1][("MoEPrepareAndFinalizeNoEP", "ZeroingExperts")]
    assert all(re.fullmatch(r"FAIL \[\d+\]", row[scheme_label("bfloat16", q.name)]) for _, q in SCHEMES)


def test_launched_cells_fail_alone(tmp_path):
    """World size 2, one launch: a cell that raises on one rank (its peer times out in a
    collective) and a cell whose rank dies fail; the cells after each still run and pass."""
    ok = dict(prepare_finalize_type=AllToAllPrepareAndFinalize, fused_experts_type=TorchExperts)
    cells = []
    for fe in (RaisingOnRank1Experts, TorchExperts, ExitingOnRank1Experts, TorchExperts):
        cells += matrix_configs([ok["prepare_finalize_type"]], [fe], SCHEMES[:1], (2,), **SMALL)
    assert all(valid for _, valid, _ in cells)
    records = run_cells(cells, collective_timeout_s=5.0, progress=False)
    assert [r.result for r in records] == ["FAIL", "PASS", "FAIL", "PASS"], records
    assert "rank 1" in records[0].detail and "injected failure on rank 1" in records[0].detail
    assert records[2].detail.startswith("launch failed: ") and "rank 1: exited with code 3" in records[2].detail


BAD_ARGS = [
    (["--world-sizes", "0"], "--world-sizes ([0]) must all be >= 1"),  # no ranks
    (["-m", "-2"], "-m ([-2]) must be >= 0"),  # negative M
    (["--topk", "0"], "--topk ([0]) must be >= 1"),  # topk below 1
]


@pytest.mark.parametrize("argv,message", BAD_ARGS)
def test_bad_arguments_exit_2(tmp_path, capsys, argv, message):
    assert main(argv + ["--out-dir", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
