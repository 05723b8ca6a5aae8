"""tools/benchmark_ep.py: the PFs' bytes-moved arithmetic (their wire_bytes) by hand, the command line's errors,
and the smoke run at world size 2 on gloo (every EP PF listed, PASS / SKIP with reasons, a broken PF reported
FAIL)."""
from __future__ import annotations

import csv
import math

import pytest
import torch

from moe_modular.prepare_finalize.all_to_all_prepare_and_finalize import AllToAllPrepareAndFinalize
from moe_modular.prepare_finalize.allgather_reducescatter_prepare_and_finalize import (
    AllGatherReduceScatterPrepareAndFinalize,
)
from moe_modular.prepare_finalize.combine_wire import COMBINE_WIRES
from moe_modular.prepare_finalize.deepep_ht_prepare_and_finalize import DeepEPHTPrepareAndFinalize
from moe_modular.prepare_finalize.deepep_ll_prepare_and_finalize import DeepEPLLPrepareAndFinalize
from moe_modular.prepare_finalize.ep_common import ExpertPlacementTables
from moe_modular.prepare_finalize.low_latency_all2all_prepare_and_finalize import LowLatencyAll2AllPrepareAndFinalize
from moe_modular.prepare_finalize.naive_all2all_prepare_and_finalize import NaiveAll2AllPrepareAndFinalize
from moe_modular.prepare_finalize.slice_allgather_prepare_and_finalize import SliceAllGatherPrepareAndFinalize
from moe_modular.prepare_finalize.symm_mem_prepare_and_finalize import SymmMemPrepareAndFinalize
from moe_modular.wire_bytes import PhaseBytes, RouteCounts
from moe_modular.quant import QuantConfig
from moe_modular.registry import NO_EP_BACKEND, PREPARE_FINALIZE_BY_BACKEND
from tools import benchmark_ep as bep

# ---- bytes moved ------------------------------------------------------------------------------
# Two ranks, two tokens each, top-2; the owning rank of every route:
#   rank 0: token 0 -> ranks (0, 1), token 1 -> (0, 0)
#   rank 1: token 0 -> ranks (0, 0), token 1 -> (1, 0)
# tokens per destination (pairs): rank 0 -> (2, 1), rank 1 -> (2, 1)
# routes per destination:         rank 0 -> (3, 1), rank 1 -> (3, 1)
# sent to the other rank: pairs (1, 2), routes (1, 3); sent back: pairs (2, 1), routes (3, 1).
OWNERS = torch.tensor([[[0, 1], [0, 0]], [[0, 0], [1, 0]]])
K = 256
BF16_ROW = K * 2
FP8_BLOCK_ROW = K + 2 * 4  # fp8 values + two 1x128 group scales (float32)
FP8_TOKEN_ROW = K + 4  # fp8 values + one per-token scale


def moe_for(qc: QuantConfig, max_tokens: int = 2, rank: int = 0):
    return bep.moe_config(bep.Problem("hand", 4, K, 64, 2), qc, 2, rank, max_tokens)


def test_route_counts_from_owners():
    c = RouteCounts.from_owners(OWNERS)
    assert c.pairs == ((2, 1), (2, 1)) and c.routes == ((3, 1), (3, 1))
    assert c.sent(c.pairs) == [1, 2] and c.returned(c.pairs) == [2, 1]
    assert c.sent(c.routes) == [1, 3] and c.returned(c.routes) == [3, 1]


def test_route_counts_ignore_routes_without_expert():
    c = RouteCounts.from_owners(torch.tensor([[[-1, -1]], [[0, -1]]]))
    assert c.pairs == ((0, 0), (1, 0)) and c.routes == ((0, 0), (1, 0))


BF16, FP8_BLOCK, FP8_TOKEN = QuantConfig.unquantized(), QuantConfig.fp8_block((128, 128)), QuantConfig.fp8_per_token()
W2 = COMBINE_WIRES

BYTE_CASES = [
    # (model, scheme, wire, experts reduce, dispatch bytes per rank, combine bytes per rank)
    # token-level exchange: one row per (token, other rank); prereduced: one bf16 row back per entry
    (AllToAllPrepareAndFinalize.wire_bytes, BF16, W2["prereduced"], False, (1 * BF16_ROW, 2 * BF16_ROW), (2 * BF16_ROW, 1 * BF16_ROW)),
    # hi + lo: two rows back per entry
    (AllToAllPrepareAndFinalize.wire_bytes, BF16, W2["prereduced_hilo"], False, (512, 1024), (4 * BF16_ROW, 2 * BF16_ROW)),
    # per_route with experts that leave route rows: one row per route back (3 and 1 routes)
    (AllToAllPrepareAndFinalize.wire_bytes, BF16, W2["per_route"], False, (512, 1024), (3 * BF16_ROW, 1 * BF16_ROW)),
    # per_route with experts that reduce themselves: one row per (token, rank), like prereduced
    (AllToAllPrepareAndFinalize.wire_bytes, BF16, W2["per_route"], True, (512, 1024), (2 * BF16_ROW, 1 * BF16_ROW)),
    # fp8: 1-byte values plus the scales that travel in the row; the combine stays bf16
    (AllToAllPrepareAndFinalize.wire_bytes, FP8_BLOCK, W2["prereduced"], False, (FP8_BLOCK_ROW, 2 * FP8_BLOCK_ROW), (1024, 512)),
    (AllToAllPrepareAndFinalize.wire_bytes, FP8_TOKEN, W2["prereduced"], False, (FP8_TOKEN_ROW, 2 * FP8_TOKEN_ROW), (1024, 512)),
    # slice + all-gather: the all-to-all, then (W-1) * T rows of the bf16 output gathered
    (SliceAllGatherPrepareAndFinalize.wire_bytes, BF16, W2["prereduced"], False, (512, 1024), (1024 + 2 * BF16_ROW, 512 + 2 * BF16_ROW)),
    # broadcasts: T rows from each of the W-1 others; all-reduce of (W*T, K) float32: 2 (W-1) T K 4
    (NaiveAll2AllPrepareAndFinalize.wire_bytes, BF16, None, False, (2 * BF16_ROW,) * 2, (2 * 1 * 2 * K * 4,) * 2),
    (NaiveAll2AllPrepareAndFinalize.wire_bytes, FP8_BLOCK, None, False, (2 * FP8_BLOCK_ROW,) * 2, (4096,) * 2),
    # all-gather the same rows; reduce-scatter sends (W-1) T K float32
    (AllGatherReduceScatterPrepareAndFinalize.wire_bytes, BF16, None, False, (2 * BF16_ROW,) * 2, (1 * 2 * K * 4,) * 2),
    # fixed slots: El (2) x Tm (2) rows to the other rank whatever the routing, both ways
    (LowLatencyAll2AllPrepareAndFinalize.wire_bytes, BF16, None, False, (4 * BF16_ROW,) * 2, (4 * BF16_ROW,) * 2),
    (LowLatencyAll2AllPrepareAndFinalize.wire_bytes, FP8_BLOCK, None, False, (4 * FP8_BLOCK_ROW,) * 2, (4 * BF16_ROW,) * 2),
    # one row per route, out and back
    (SymmMemPrepareAndFinalize.wire_bytes, BF16, None, False, (1 * BF16_ROW, 3 * BF16_ROW), (3 * BF16_ROW, 1 * BF16_ROW)),
    # DeepEP low latency: per route at the kernel hidden 2048, fp8 with 2048/128 scales for 1x128 groups
    (DeepEPLLPrepareAndFinalize.wire_bytes, BF16, None, False, (1 * 4096, 3 * 4096), (3 * 4096, 1 * 4096)),
    (DeepEPLLPrepareAndFinalize.wire_bytes, FP8_BLOCK, None, False, (1 * 2112, 3 * 2112), (3 * 4096, 1 * 4096)),
    # DeepEP high throughput: per (token, rank); K=256 bf16 is one 512-byte unit already
    (DeepEPHTPrepareAndFinalize.wire_bytes, BF16, None, False, (512, 1024), (1024, 512)),
    # fp8 rows must be whole 512-byte units too: K padded to 512, plus two group scales
    (DeepEPHTPrepareAndFinalize.wire_bytes, FP8_BLOCK, None, False, (512 + 8, 2 * (512 + 8)), (2 * 1024, 1024)),
]


@pytest.mark.parametrize("model,qc,wire,reduce,dispatch,combine", BYTE_CASES,
                         ids=[f"{c[0].__self__.__name__}-{c[1].name}-{c[2].name if c[2] else '-'}-{c[3]}" for c in BYTE_CASES])
def test_bytes_moved(model, qc, wire, reduce, dispatch, combine):
    got = model(moe_for(qc), RouteCounts.from_owners(OWNERS), wire, reduce)
    assert got.dispatch == dispatch
    assert got.combine == combine


def test_deepep_ht_padding_is_what_the_pf_uses():
    # The byte model reads the PF's own padding: fp8 group rows pad K=256 to 512 (512-byte units of fp8).
    assert DeepEPHTPrepareAndFinalize.padded_hidden_size(moe_for(FP8_BLOCK)) == 512
    assert DeepEPHTPrepareAndFinalize.padded_hidden_size(moe_for(BF16)) == 256


def test_one_rank_moves_nothing():
    c = RouteCounts.from_owners(torch.zeros((1, 3, 2), dtype=torch.int64))
    moe = bep.moe_config(bep.Problem("hand", 4, K, 64, 2), BF16, 1, 0, 3)
    for model in (AllToAllPrepareAndFinalize.wire_bytes, NaiveAll2AllPrepareAndFinalize.wire_bytes, LowLatencyAll2AllPrepareAndFinalize.wire_bytes, SymmMemPrepareAndFinalize.wire_bytes):
        got = model(moe, c, W2["prereduced"], False)
        assert got.dispatch == (0,) and got.combine == (0,), model.__self__.__name__


# ---- command line -------------------------------------------------------------------------------

CLI_ERRORS = [
    (["--smoke", "--pf-types", "nccl_all_to_all", "pplx"], "--pf-types ('pplx') must be one of"),
    (["--smoke", "--wires", "per_token"], "--wires ('per_token') must be one of ['per_route', 'prereduced', "
                                          "'prereduced_hilo']"),
    (["--smoke", "--dispatch", "fp4"], "--dispatch ('fp4') must be one of"),
    (["--smoke", "--world-size", "0"], "--world-size (0) must be an int >= 1"),
    (["--smoke", "--world-size", "3"], "--world-size (3) must divide the number of experts (16)"),
    (["--smoke", "--tokens-per-rank", "0"], "--tokens-per-rank (0) must be >= 1"),
]


@pytest.mark.parametrize("argv,message", CLI_ERRORS, ids=[a[-1] for a, _ in CLI_ERRORS])
def test_bad_arguments_name_the_field(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bep.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_every_registered_ep_pf_has_a_spec_and_a_byte_model():
    ep = [n for n in PREPARE_FINALIZE_BY_BACKEND if n != NO_EP_BACKEND]
    assert list(bep.PF_SPECS)[:len(ep)] == ep and bep.SLICE_ALLGATHER in bep.PF_SPECS
    counts = RouteCounts.from_owners(OWNERS)
    for name, spec in bep.PF_SPECS.items():
        moved = spec.bytes_model(moe_for(BF16), counts, None, False)
        assert isinstance(moved, PhaseBytes) and len(moved.dispatch) == len(moved.combine) == 2, name
        assert sum(moved.dispatch) > 0 and sum(moved.combine) > 0, name  # OWNERS sends across ranks both ways


def test_vllm_all2all_names_come_from_the_pf_classes():
    from moe_modular.integrations.vllm import VLLM_TO_MOE_MODULAR_ALL2ALL

    assert dict(VLLM_TO_MOE_MODULAR_ALL2ALL) == {
        "naive": "naive", "allgather_reducescatter": "allgather_reducescatter",
        "deepep_high_throughput": "deepep_high_throughput", "deepep_low_latency": "deepep_low_latency"}


# ---- the smoke run ---------------------------------------------------------------------------------

class CorruptOutputAllToAll(AllToAllPrepareAndFinalize):
    """A deliberately broken PF: the all-to-all's combine, then every output value scaled by 1.5."""

    def finalize(self, output, *args, **kwargs) -> None:
        super().finalize(output, *args, **kwargs)
        output.mul_(1.5)


BROKEN = bep.PFSpec("corrupt_all_to_all", CorruptOutputAllToAll, AllToAllPrepareAndFinalize.wire_bytes, bep.make_wired, wired=True)


def _read(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark_ep")
    _, cfg = bep.parse_args(["--smoke"])
    rows, meta = bep.run(cfg, str(out), [*bep.PF_SPECS.values(), BROKEN], backend="gloo", timeout_s=240)
    return cfg, rows, meta, _read(out / "benchmark_ep.csv"), out


def test_smoke_lists_every_cell(smoke):
    cfg, rows, _, csv_rows, _ = smoke
    assert cfg.world_size == 2 and cfg.problem == bep.SMOKE_PROBLEM
    assert len(csv_rows) == len(rows) == len(cfg.cells([*bep.PF_SPECS.values(), BROKEN]))
    listed = {r["pf"] for r in csv_rows}
    assert set(bep.PF_SPECS) | {BROKEN.name} == listed
    for name in PREPARE_FINALIZE_BY_BACKEND:
        assert (name in listed) == (name != NO_EP_BACKEND)


def test_smoke_supported_pass_refused_skip(smoke):
    cfg, _, _, csv_rows, _ = smoke
    for r in (r for r in csv_rows if r["pf"] != BROKEN.name):
        spec = bep.PF_SPECS[r["pf"]]
        moe = bep.cell_moe(spec, cfg.problem, bep.DISPATCH_SCHEMES[r["dispatch"]], 2, 0, int(r["tokens_per_rank"]))
        ok, reason = spec.cls.supports(moe)
        where = f"{r['pf']} {r['wire']} {r['dispatch']} T={r['tokens_per_rank']}"
        if not ok:
            assert r["status"] == "SKIP" and r["reason"] == reason and reason, where
            continue
        assert r["status"] == "PASS", (where, r["reason"])
        for f in ("dispatch_us", "combine_us", "layer_us", "dispatch_bytes", "combine_bytes", "dispatch_GBps",
                  "combine_GBps"):
            assert float(r[f]) > 0, (where, f)
        assert math.isfinite(float(r["rel_err"])) and float(r["rel_err"]) <= float(r["tol"]), where
        assert r["experts"] in ("TorchExperts", "NaiveBatchedExperts"), where
    # the combine wires each get their own cells on the PFs that use them
    a2a = {(r["wire"]) for r in csv_rows if r["pf"] == "nccl_all_to_all"}
    assert a2a == set(COMBINE_WIRES)


def test_smoke_deepep_skips_with_its_reason(smoke):
    from all2all.deepep import deep_ep_unavailable_reason

    if deep_ep_unavailable_reason() is None:
        pytest.skip("deep_ep is installed here")
    rows = [r for r in smoke[3] if r["pf"].startswith("deepep_")]
    assert rows and all(r["status"] == "SKIP" and r["reason"] == "deep_ep is not installed" for r in rows)


def test_smoke_broken_pf_is_fail(smoke):
    rows = [r for r in smoke[3] if r["pf"] == BROKEN.name]
    assert len(rows) == len(smoke[0].dispatch) * len(smoke[0].tokens_per_rank) * len(COMBINE_WIRES)
    for r in rows:
        assert r["status"] == "FAIL" and "relative error" in r["reason"] and "> tolerance" in r["reason"], r
        assert float(r["rel_err"]) > float(r["tol"])


def test_smoke_bytes_follow_the_routing(smoke):
    # The CSV's all-to-all prereduced bytes are the model applied to the run's own routing.
    cfg, _, _, csv_rows, _ = smoke
    for r in (r for r in csv_rows if r["pf"] == "nccl_all_to_all" and r["wire"] == "prereduced"):
        T, qc = int(r["tokens_per_rank"]), bep.DISPATCH_SCHEMES[r["dispatch"]]
        moe = bep.moe_config(cfg.problem, qc, 2, 0, T)
        _, ids = bep.make_routing(cfg.problem, 2, T, cfg.seed)
        owners = ExpertPlacementTables.build(moe, torch.device("cpu")).owner_of(ids).view(2, T, cfg.problem.topk)
        want = AllToAllPrepareAndFinalize.wire_bytes(moe, RouteCounts.from_owners(owners), COMBINE_WIRES["prereduced"], False)
        assert int(r["dispatch_bytes"]) == max(want.dispatch) and int(r["combine_bytes"]) == max(want.combine)


def test_smoke_records_the_hardware_and_link(smoke):
    import json

    _, _, meta, _, out = smoke
    with open(out / "benchmark_ep.json") as f:
        saved = json.load(f)
    assert saved["backend"] == "gloo" and saved["torch"] == torch.__version__ and saved["device"] == "cpu"
    assert saved["link_GBps"] is None and saved["link_note"].startswith("not measured")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (out / "benchmark_ep.png").exists()
    else:
        assert (out / "benchmark_ep.png").stat().st_size > 0


def test_table_marks_fail_and_skip(smoke):
    text = bep.table_text(smoke[1], smoke[2])
    assert "| FAIL: layer output vs the float32 oracle" in text
    assert "| SKIP: " in text
    header_cols = text.splitlines()[2].count("|")
    assert all(line.count("|") >= header_cols for line in text.splitlines() if line.startswith("| bf16"))
