"""tools/benchmark_moe.py and tools/tune_moe.py: the floor arithmetic, input rotation, and both tools
end to end on tiny shapes on the CPU (--smoke)."""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os

import pytest
import torch

from moe_modular.quant import QuantConfig
from tools import bench_common as bc
from tools import benchmark_moe as bm

H200_CEILINGS = {"copy_Bps": 4.24e12, "bf16_flops": 701e12, "fp8_flops": 1400e12}

FLOOR_CASES = [
    # (shape, quant, M, distinct experts, expected bound)
    (bc.SHAPES["mixtral"], QuantConfig(), 1, 2, "memory"),  # decode: two experts' weights streamed
    (bc.SHAPES["mixtral"], QuantConfig(), 16384, 8, "compute"),  # prefill: every expert, flops dominate
    (bc.SHAPES["qwen3"], QuantConfig.fp8_block((128, 128)), 1, 8, "memory"),  # fp8: 1-byte weights
    (bc.SHAPES["deepseek-v3"], QuantConfig.fp8_per_token(), 16384, 256, "compute"),  # fp8 matmul rate
]


@pytest.mark.parametrize("shape,qc,M,distinct,bound", FLOOR_CASES, ids=lambda v: str(v)[:40])
def test_floor_matches_benchmarks_md(shape, qc, M, distinct, bound):
    nbytes, flops, t, got_bound = bc.floor_of(shape, qc, M, distinct, H200_CEILINGS)
    per_weight = 1 if qc.is_quantized else 2
    assert nbytes == distinct * 3 * shape.N * shape.K * per_weight + 2 * M * shape.K * 2
    assert flops == 2 * M * shape.topk * 3 * shape.N * shape.K
    rate = H200_CEILINGS["fp8_flops" if qc.is_quantized else "bf16_flops"]
    assert t == pytest.approx(max(nbytes / H200_CEILINGS["copy_Bps"], flops / rate))
    assert got_bound == bound


def test_floor_without_a_matmul_rate_is_memory_only():
    # An fp8 run on a device where the fp8 rate could not be measured: the memory floor alone.
    ceil = dict(H200_CEILINGS, fp8_flops=0.0)
    nbytes, _, t, bound = bc.floor_of(bc.SHAPES["qwen3"], QuantConfig.fp8_per_token(), 64, 100, ceil)
    assert bound == "memory" and t == pytest.approx(nbytes / ceil["copy_Bps"])


def test_rotation_only_where_the_data_fits_in_l2():
    l2 = 50 << 20
    qwen, mixtral = bc.SHAPES["qwen3"], bc.SHAPES["mixtral"]
    assert bc.n_sets_for(qwen, QuantConfig(), 1, l2) > 1  # 8 small experts: 75 MB per forward
    assert bc.n_sets_for(qwen, QuantConfig(), 1024, l2) == 1  # every expert: 1.2 GB
    assert bc.n_sets_for(mixtral, QuantConfig(), 1, l2) == 1  # two experts: 700 MB
    assert bc.n_sets_for(qwen, QuantConfig(), 1, 0) == 1  # CPU: no L2 figure, no rotation
    assert bc.n_sets_for(bc.SMOKE_SHAPES["tiny"], QuantConfig(), 1, l2) == bc.MAX_SETS


def test_inputs_are_seeded_and_count_distinct_experts():
    shape = bc.SMOKE_SHAPES["tiny-e16"]
    a = bc.make_inputs(shape, 9, 2, torch.device("cpu"), seed=3)
    b = bc.make_inputs(shape, 9, 2, torch.device("cpu"), seed=3)
    assert torch.equal(a[0].topk_ids, b[0].topk_ids) and not torch.equal(a[0].topk_ids, a[1].topk_ids)
    for s in a:
        assert s.distinct == torch.unique(s.topk_ids).numel()
        assert torch.allclose(s.topk_weights.sum(-1), torch.ones(9))
        # top-k ids of one token are distinct experts
        assert all(len(set(row.tolist())) == shape.topk for row in s.topk_ids)


def test_benchmark_smoke_on_cpu(tmp_path):
    rc = bm.main(["--smoke", "--out", str(tmp_path), "--experts", "grouped_mm", "--shapes", "tiny", "tiny-e16",
                  "-m", "1", "8"])
    assert rc == 0
    with open(tmp_path / "benchmark_moe.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {r["shape"] for r in rows} == {"tiny", "tiny-e16"}
    for r in rows:
        assert r["status"] == "ok", r["status"]
        assert float(r["eager_us"]) > 0 and float(r["floor_us"]) > 0
        assert float(r["frac_eager"]) == pytest.approx(float(r["floor_us"]) / float(r["eager_us"]))
        assert float(r["check_rel_err"]) < 2 * torch.finfo(torch.bfloat16).eps
        assert float(r["experts_us"]) > 0  # the experts phase was timed on its own
    text = (tmp_path / "benchmark_moe.md").read_text()
    assert "| tiny | grouped_mm |" in text and "geometric mean" in text
    assert (tmp_path / "ceilings.json").exists()
    # --render rebuilds the same tables from the CSV and ceilings.json alone.
    (tmp_path / "benchmark_moe.md").unlink()
    assert bm.main(["--render", str(tmp_path)]) == 0
    assert (tmp_path / "benchmark_moe.md").read_text() == text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "benchmark_moe.png").stat().st_size > 0


def test_benchmark_resume_keeps_the_cells_done_and_measures_the_rest(tmp_path, capsys):
    # A run cut short (here: one cell missing, one failed) goes on with --resume: the kept cells are not measured
    # again, the missing and failed ones are, with the later call's index and its ceilings listed.
    args = ["--smoke", "--out", str(tmp_path), "--experts", "grouped_mm", "--shapes", "tiny", "-m", "1", "8", "16"]
    assert bm.main(args) == 0
    path = tmp_path / "benchmark_moe.csv"
    first = bc.read_csv(str(path))
    assert [r["call"] for r in first] == [0, 0, 0]
    kept, failed = first[0], dict(first[1], status="error: cut")
    bc.write_csv(str(path), [kept, failed], bm.CSV_FIELDS)  # M=16 never ran, M=8 failed
    capsys.readouterr()
    assert bm.main(args + ["--resume"]) == 0
    assert "resuming" in capsys.readouterr().err
    rows = {r["M"]: r for r in bc.read_csv(str(path))}
    assert sorted(rows) == [1, 8, 16]
    assert rows[1] == kept  # not measured again
    assert rows[8]["status"] == "ok" and rows[8]["call"] == 1 and rows[16]["call"] == 1
    with open(tmp_path / "ceilings.json") as f:
        ceil = json.load(f)
    assert len(ceil["calls"]) == 2 and all(c["copy_Bps"] > 0 for c in ceil["calls"])
    assert "call 1 (cpu" in (tmp_path / "benchmark_moe.md").read_text()
    # every cell done: nothing is measured, the tables are written again
    assert bm.main(args + ["--resume"]) == 0
    assert {r["M"]: r for r in bc.read_csv(str(path))} == rows
    with pytest.raises(SystemExit):
        bm.parse_args(["--out", str(tmp_path / "none"), "--resume"])
    assert "--resume needs a run to go on with" in capsys.readouterr().err


def test_vllm_time_from_its_fraction():
    # Mixtral M=1 at the reference run's ceilings: a fraction of 0.83 is the memory floor / 0.83.
    row = {"vllm_frac": 0.83, "floor_bytes": 4.24e12 * 166e-6, "floor_flops": 1.0, "eager_us": 400.0,
           "graph_us": 200.0}
    assert bm.vllm_us(row) == pytest.approx(166 / 0.83)
    assert bm.best_us(row) == 200.0
    assert bm.vllm_us({"vllm_frac": None}) is None


def test_benchmark_rejects_unknown_names(capsys):
    with pytest.raises(SystemExit):
        bm.parse_args(["--quant", "int4"])
    assert "--quant ('int4') must be one of" in capsys.readouterr().err


def test_tune_smoke_writes_a_table_tile_config_reads(tmp_path):
    yaml = pytest.importorskip("yaml")
    from moe_modular.tile_config import TileConfigTable, TileKey
    from tools import tune_moe

    if torch.cuda.is_available():
        pytest.skip("the smoke tune runs the CPU interpreter")
    assert tune_moe.main(["--smoke", "--out", str(tmp_path)]) == 0
    tables = [p for p in os.listdir(tmp_path) if p.endswith(".yaml")]
    assert len(tables) == 1
    with open(tmp_path / tables[0]) as f:
        key, buckets = TileConfigTable.parse(yaml.safe_load(f), tables[0])
    shape = bc.SMOKE_SHAPES["tiny"]
    assert key == TileKey(shape.E, shape.N, shape.K, "bfloat16", "unquantized", "cpu")
    assert tables[0] == TileConfigTable.file_name(key)
    assert list(buckets) == [8]
    with open(tmp_path / "tune_moe.csv") as f:
        trials = list(csv.DictReader(f))
    # the smoke tiles plus the incumbent (what TritonExperts picks today: the CPU default heuristic), then the
    # launch option the CPU has (a persistent second GEMM) on the best of them
    stage = [int(t["stage"]) for t in trials]
    assert stage == [1] * (len(tune_moe.SMOKE_SPACE) + 1) + [3]
    assert int(trials[-1]["g2_persistent"]) == 2
    now = tune_moe.incumbent(TileConfigTable.load(), shape, tune_moe.QUANTS["bf16"], 8, "cpu")
    assert [int(trials[0][f"g1_{f}"]) for f in ("BLOCK_M", "BLOCK_N", "BLOCK_K")] == [
        now.gemm1.BLOCK_M, now.gemm1.BLOCK_N, now.gemm1.BLOCK_K]
    assert int(trials[0]["g2_BLOCK_N"]) == now.gemm2.BLOCK_N
    best = min(trials, key=lambda r: float(r["us"]))
    assert int(best["g1_BLOCK_M"]) == buckets[8].block_m and math.isfinite(float(best["us"]))


def test_tune_merge_keeps_untuned_buckets_and_times_the_shipped_tile(tmp_path, monkeypatch):
    yaml = pytest.importorskip("yaml")
    from moe_modular import tile_config
    from moe_modular.kernels.gemm_config import GemmTile
    from moe_modular.tile_config import TileConfig, TileConfigTable
    from tools import tune_moe

    if torch.cuda.is_available():
        pytest.skip("the smoke tune runs the CPU interpreter")
    shape = bc.SMOKE_SHAPES["tiny"]
    key = TileConfigTable.key_for(shape.E, shape.N, shape.K, torch.bfloat16, tune_moe.QUANTS["bf16"], "cpu")
    shipped_8 = TileConfig(GemmTile(16, 32, 64, 1, 4, 1), GemmTile(16, 64, 32, 1, 4, 1))
    shipped_1024 = TileConfig(GemmTile(64, 64, 64, 1, 4, 1), GemmTile(64, 64, 64, 1, 4, 1))
    shipped = TileConfigTable({key: {8: shipped_8, 1024: shipped_1024}})
    monkeypatch.setattr(tile_config.TileConfigTable, "load", classmethod(lambda cls, directory=None: shipped))
    assert tune_moe.main(["--smoke", "--out", str(tmp_path)]) == 0
    with open(tmp_path / TileConfigTable.file_name(key)) as f:
        _, buckets = TileConfigTable.parse(yaml.safe_load(f))
    assert sorted(buckets) == [8, 1024] and buckets[1024] == shipped_1024  # carried over, untuned
    with open(tmp_path / "tune_moe.csv") as f:
        first = next(csv.DictReader(f))
    names = [f.name for f in dataclasses.fields(GemmTile)]
    timed = TileConfig(GemmTile(*(int(first[f"g1_{k}"]) for k in names)),
                       GemmTile(*(int(first[f"g2_{k}"]) for k in names)))
    assert timed == shipped_8  # the incumbent is the shipped entry, timed first
    assert tune_moe.main(["--smoke", "--no-merge", "--out", str(tmp_path / "only")]) == 0
    with open(tmp_path / "only" / TileConfigTable.file_name(key)) as f:
        assert sorted(TileConfigTable.parse(yaml.safe_load(f))[1]) == [8]


def test_tune_launch_options_follow_the_device_and_the_tiles():
    from moe_modular.kernels.gemm_config import GemmTile, LaunchOptions
    from moe_modular.tile_config import TileConfig
    from tools import tune_moe

    bf16, block = tune_moe.QUANTS["bf16"], tune_moe.QUANTS["fp8-block"]
    tile = GemmTile(128, 256, 64, 8, 8, 4)
    wide = TileConfig(tile, tile, LaunchOptions(b_tma=1))
    got = tune_moe.launch_options(wide, hopper=True, quant=bf16, per_expert=512.0)
    assert [(c.launch1.pdl, c.launch2.pdl, c.launch2.persistent, c.launch1.ws, c.launch2.ws, c.launch1.a_tma,
             c.launch1.b_tma) for c in got] == [
        (0, 0, 2, 0, 0, 0, 1), (0, 1, 0, 0, 0, 0, 1), (1, 1, 0, 0, 0, 0, 1), (0, 0, 0, 1, 1, 1, 1)]
    assert all(c.gemm1 == c.gemm2 == tile for c in got)
    assert len(got) <= tune_moe.MAX_LAUNCH_OPTIONS
    # no unquantized warp-specialized option for fp8 (its own kernel's configurations instead, where 128-row
    # tiles are not mostly padding) or for 16-row tiles; before Hopper only the persistent launch; a best that
    # already has an option is not timed again
    fp8 = tune_moe.launch_options(wide, hopper=True, quant=block, per_expert=32.0)
    assert len(fp8) == 3 and not any(c.launch1.ws or c.launch2.ws for c in fp8)
    narrow = TileConfig(GemmTile(16, 64, 128), GemmTile(16, 64, 128), launch2=LaunchOptions(persistent=2))
    assert [c.launch2.pdl for c in tune_moe.launch_options(narrow, hopper=True, quant=bf16, per_expert=512.0)] == [
        1, 1]
    assert tune_moe.launch_options(wide, hopper=False, quant=bf16, per_expert=512.0) == [
        TileConfig(tile, tile, LaunchOptions(b_tma=1), LaunchOptions(persistent=2))]


def test_tune_times_the_fp8_warp_specialized_configurations():
    from moe_modular.tile_config import TileConfig, fp8_ws_tile_configs
    from tools import tune_moe

    for quant in (tune_moe.QUANTS["fp8-block"], tune_moe.QUANTS["fp8-token"]):
        configs = list(fp8_ws_tile_configs(quant))
        best = TileConfig(configs[0].gemm1, configs[0].gemm2)  # the same tiles in the tl.dot kernel
        got = tune_moe.launch_options(best, hopper=True, quant=quant, per_expert=512.0)
        assert got[3:] == configs and len(got) <= tune_moe.MAX_LAUNCH_OPTIONS
        # 32 routes per expert: 128-row tiles would be three quarters padding
        assert tune_moe.launch_options(best, hopper=True, quant=quant, per_expert=32.0) == got[:3]
        assert tune_moe.launch_options(best, hopper=False, quant=quant, per_expert=512.0) == got[:1]
        # a best that is one of them is not offered again
        assert configs[0] not in tune_moe.launch_options(configs[0], hopper=True, quant=quant, per_expert=512.0)
    assert len(tune_moe.launch_options(best, hopper=True, quant=tune_moe.QUANTS["fp8-tensor"], per_expert=512.0)) == 3


def test_tune_gemm2_candidates_skip_what_was_timed():
    from tools import tune_moe

    flags = (0, 0, 1)  # b_tma, a_tma, act_q: the last three candidate fields
    best = (16, 64, 128, 1, 4, 4) + flags
    pool = [best, (16, 32, 128, 1, 4, 4, 0, 0, 0), (32, 64, 64, 1, 4, 4, 1, 0, 0)]
    # stage 2 keeps best's BLOCK_M and act_q (a first-GEMM option), drops best itself and the second-GEMM
    # tiles already timed
    assert tune_moe.gemm2_candidates(best, pool, tried=((16, 32, 128, 1, 4, 4) + flags,)) == [
        (16, 64, 64, 1, 4, 4, 1, 0, 1)]
    assert tune_moe.gemm2_candidates(best, pool) == [(16, 32, 128, 1, 4, 4) + flags, (16, 64, 64, 1, 4, 4, 1, 0, 1)]
    # a decode tile with BLOCK_M raised to a prefill BLOCK_M can overflow shared memory: pruned
    wide = (128, 256, 64, 8, 8, 3, 0, 0, 0)
    deep = [(16, 64, 256, 1, 4, 4, 0, 0, 0), (16, 32, 128, 1, 4, 4, 0, 0, 0)]
    fits = lambda t: tune_moe._fits(t, 2, 1024.0, None)  # noqa: E731
    assert tune_moe.gemm2_candidates(wide, deep, fits=fits) == [(128, 32, 128, 1, 4, 4, 0, 0, 0)]
    # a configuration with fields the tuner does not sweep (persistent): its candidate tuple is best's, act_q last
    from moe_modular.kernels.gemm_config import GemmTile, LaunchOptions
    from moe_modular.tile_config import TileConfig

    tile = GemmTile(16, 64, 128, 1, 4, 4)
    cfg = TileConfig(tile, tile, LaunchOptions(persistent=2), act_q=1)
    assert tune_moe._tuned(cfg, "gemm1") == best
    assert tune_moe._config(best, best) == TileConfig(tile, tile, act_q=1)


def test_tune_space_is_pruned():
    from tools import tune_moe

    # fp8 block: BLOCK_K never crosses the 128-wide scale group.
    assert all(t[2] <= 128 for t in tune_moe.candidates("full", 1, 64.0, 128, None, 0))
    # decode: no 128-row tiles when experts get a token or two.
    assert all(t[0] == 16 for t in tune_moe.candidates("full", 2, 0.5, None, None, 0))
    # shared memory: stages * (BM*BK + BK*BN) * bytes within the budget.
    for t in tune_moe.candidates("full", 2, 1024.0, None, None, 0):
        assert t[5] * (t[0] * t[2] + t[2] * t[1]) * 2 <= tune_moe.SMEM_BYTES
    assert len(tune_moe.candidates("full", 2, 1024.0, None, 7, 0)) == 7
    # each tile once per weight-load path, activation-load path and act_q, the three last candidate fields
    one, both = (tune_moe.candidates("small", 2, 64.0, None, None, 0, b_tma) for b_tma in ((0,), (0, 1)))
    assert {t[-3:] for t in one} == {(0, 0, 0)}
    assert sorted(both) == sorted(one + [t[:-3] + (1, 0, 0) for t in one])
    four = tune_moe.candidates("small", 2, 64.0, None, None, 0, (0, 1), (0, 1))
    assert sorted(four) == sorted(both + [t[:-2] + (1, 0) for t in both])
    # act_q only with a group (fp8 block) that BLOCK_N / 2 holds whole
    fp8 = tune_moe.candidates("small", 1, 1024.0, 128, None, 0, (0,), (0,), (0, 1))
    plain = [t for t in fp8 if not t[-1]]
    assert sorted(fp8) == sorted(plain + [t[:-1] + (1,) for t in plain if t[1] // 2 % 128 == 0])
    assert any(t[-1] for t in fp8)
    assert not any(t[-1] for t in tune_moe.candidates("small", 2, 1024.0, None, None, 0, (0,), (0,), (0, 1)))


# ---- tools/experiments/ab_tiles.py --------------------------------------------------------------------------
def test_ab_tiles_smoke_times_base_and_variant_side_by_side(tmp_path):
    from tools.experiments import ab_tiles

    if torch.cuda.is_available():
        pytest.skip("the smoke A/B runs the CPU interpreter")
    assert ab_tiles.main(["--smoke", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "ab_tiles.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["variant"] for r in rows] == ["base", "b_tma=1"]
    base, tma = rows
    assert float(base["ratio"]) == 1.0 and not base["error"] and not tma["error"]
    assert float(tma["ratio"]) == pytest.approx(float(base["us"]) / float(tma["us"]))
    assert "'b_tma': 1" in tma["tiles"] and "b_tma" not in base["tiles"]


# (override, message): each names what is wrong and what is allowed
BAD_OVERRIDES = [
    ("BLOK_N=64", r"field 'BLOK_N' must be one of \['BLOCK_M'"),  # a misspelt field
    ("gemm3.BLOCK_N=64", r"prefix 'gemm3' must be one of \['gemm1', 'gemm2'\]"),  # no such GEMM
    ("gemm2.BLOCK_M=32", "BLOCK_M is shared by both GEMMs"),  # would split the alignment block
    ("BLOCK_N", "must be FIELD=INTEGER"),  # no value
    ("num_warps=four", "must be FIELD=INTEGER"),  # not an integer
]


@pytest.mark.parametrize("token,message", BAD_OVERRIDES, ids=[t for t, _ in BAD_OVERRIDES])
def test_ab_tiles_rejects_bad_overrides(token, message):
    from tools.experiments import ab_tiles

    with pytest.raises(ValueError, match=message):
        ab_tiles.parse_override(token)


def test_ab_tiles_overrides_apply_per_gemm_and_are_validated():
    from moe_modular.kernels.gemm_config import GemmTile, LaunchOptions
    from moe_modular.tile_config import TileConfig
    from tools.experiments import ab_tiles

    base = TileConfig(GemmTile(64, 128, 64, 8, 4, 3), GemmTile(64, 64, 128, 1, 4, 3))
    both = ab_tiles.apply_overrides(base, [ab_tiles.parse_override("b_tma=1"),
                                           ab_tiles.parse_override("gemm2.num_stages=4")])
    assert both == TileConfig(GemmTile(64, 128, 64, 8, 4, 3), GemmTile(64, 64, 128, 1, 4, 4), LaunchOptions(b_tma=1),
                              LaunchOptions(b_tma=1))
    with pytest.raises(ValueError, match="power of two"):
        ab_tiles.apply_overrides(base, [ab_tiles.parse_override("gemm1.BLOCK_N=96")])
    with pytest.raises(ValueError, match=r"gemm2's act_q \(1\) must equal gemm1's \(0\)"):
        ab_tiles.apply_overrides(base, [ab_tiles.parse_override("gemm2.act_q=1")])


def test_ab_tiles_reports_a_variant_that_cannot_run_and_keeps_timing_the_others():
    from tools.experiments import ab_tiles

    calls = []

    def trial(cfg):
        calls.append(cfg)
        if cfg == "broken":
            raise RuntimeError("out of resources: shared memory")
        return {"base": 2.0, "fast": 1.0}[cfg] + 0.1 * len(calls)  # later rounds are slower

    best = ab_tiles.time_variants(trial, [("base", "base"), ("fast", "fast"), ("broken", "broken")], rounds=2)
    assert best["base"] == (pytest.approx(2.1), "") and best["fast"] == (pytest.approx(1.2), "")
    assert best["broken"][0] == float("inf") and "out of resources" in best["broken"][1]
    assert calls.count("broken") == 1  # a failed variant is not retried


def test_variant_times_us_converts_prints_and_flags_failures(capsys):
    from tools.experiments import ab_tiles

    us, failed = ab_tiles.variant_times_us({"this": (12.5e-6, ""), "baseline": (25e-6, "")}, "qwen3 M=8 alignment")
    assert us == {"this": pytest.approx(12.5), "baseline": pytest.approx(25.0)} and not failed
    assert "qwen3 M=8 alignment this: 12.50 us" in capsys.readouterr().out
    us, failed = ab_tiles.variant_times_us({"this": (3e-6, ""), "broken": (float("inf"), "RuntimeError: no")}, "c")
    assert us == {"this": pytest.approx(3.0), "broken": None} and failed
    assert "c broken: failed: RuntimeError: no" in capsys.readouterr().out


# ---- tools/experiments/routing_cost.py ------------------------------------------------------------------
def test_routing_cost_balanced_ids_give_every_expert_the_same_routes():
    from tools.experiments import routing_cost

    ids = routing_cost.balanced_ids(48, 4, 16, torch.device("cpu"))
    assert ids.shape == (48, 4) and ids.dtype == torch.int32
    assert torch.bincount(ids.reshape(-1).long(), minlength=16).tolist() == [12] * 16
    assert all(len(set(row)) == 4 for row in ids.tolist())  # a token's routes hit distinct experts
    with pytest.raises(ValueError, match=r"M \(5\) \* topk \(4\) must be a multiple of E \(16\)"):
        routing_cost.balanced_ids(5, 4, 16, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"topk \(4\) must be at most E \(2\)"):
        routing_cost.balanced_ids(4, 4, 2, torch.device("cpu"))


def test_routing_cost_counts_padded_rows_per_expert():
    from tools.experiments import routing_cost

    # expert 0: 3 routes, expert 1: 17, expert 2: none, expert 3: 16 -> 16 + 32 + 0 + 16 rows of 16-row blocks
    ids = torch.tensor([0] * 3 + [1] * 17 + [3] * 16)[torch.randperm(36)].view(12, 3)
    assert routing_cost.padded_rows(ids, 4, 16) == 64
    assert routing_cost.padded_rows(ids, 4, 1) == 36


def test_routing_cost_smoke_times_both_routings_and_bmm(tmp_path):
    from tools.experiments import routing_cost

    assert routing_cost.main(["--smoke", "--shapes", "tiny-e16", "-m", "16", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "routing_cost.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1
    r = rows[0]
    E, routes, bm = int(r["E"]), int(r["routes"]), int(r["block_m"])
    assert routes == 16 * 4 and E == 16
    assert int(r["rows_balanced"]) == E * math.ceil(routes // E / bm) * bm
    assert routes <= int(r["rows_random"]) <= E * math.ceil(routes / bm) * bm
    for k in ("random", "balanced", "bmm"):
        assert float(r[f"us_{k}"]) > 0
        assert float(r[f"tflops_{k}"]) == pytest.approx(2 * routes * 3 * 64 * 128 / float(r[f"us_{k}"]) / 1e6)
    for k in ("random", "balanced"):
        assert float(r[f"err_{k}"]) < 2 * torch.finfo(torch.bfloat16).eps
    assert float(r["l2_read_Bps"]) > 0 and float(r["bf16_flops"]) > 0


def test_l2_read_checks_that_every_program_read_its_blocks(monkeypatch):
    from tools.experiments import l2_read

    timer = bc.Timer(torch.device("cpu"), rep_ms=1.0, min_reps=1, max_reps=2)
    assert l2_read.l2_read_Bps(timer, smoke=True) > 0

    class Skipped:  # a launch that reads nothing: the output keeps its NaN poison
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(l2_read, "_l2_read_kernel", Skipped())
    with pytest.raises(RuntimeError, match="sums are not 4"):
        l2_read.l2_read_Bps(timer, smoke=True)


def test_routing_cost_rejects_an_m_that_cannot_be_balanced(capsys):
    from tools.experiments import routing_cost

    with pytest.raises(SystemExit):
        routing_cost.parse_args(["--smoke", "--shapes", "tiny", "-m", "3"])
    assert "-m (3): M * topk (2) must be a positive multiple of E (8) for shape tiny" in capsys.readouterr().err


# ---- tools/experiments/align_time.py --------------------------------------------------------------------
def test_align_time_smoke_checks_and_times_this_tree_against_a_baseline(tmp_path, capsys):
    from tools.experiments import align_time

    baseline = os.path.join(os.path.dirname(align_time.__file__), "..", "..", "moe_modular", "kernels", "moe_align.py")
    assert align_time.main(["--smoke", "--shapes", "tiny-e16", "-m", "1", "40", "--baseline", baseline, "--forward",
                            "--out", str(tmp_path)]) == 0
    assert "| tiny-e16 | 40 | 160 |" in capsys.readouterr().out
    with open(tmp_path / "align_time.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["M"]), int(r["routes"])) for r in rows] == [(1, 4), (40, 160)]
    for r in rows:
        for p in ("", "fwd_"):
            assert float(r[p + "us"]) > 0 and float(r[p + "us_baseline"]) > 0
            assert float(r[p + "baseline_over_this"]) == pytest.approx(float(r[p + "us_baseline"]) / float(r[p + "us"]))


def test_align_time_forward_uses_the_version_under_test_and_restores_the_shipped_one():
    from moe_modular.experts import triton_experts
    from moe_modular.kernels import moe_align as align_module
    from tools.experiments import align_time

    calls = []

    class Recording:
        @staticmethod
        def moe_align(*args, **kwargs):
            calls.append(args[1:3])
            return align_module.moe_align(*args, **kwargs)

    shipped = triton_experts.moe_align
    with align_time.forward_alignment(Recording):
        ids = torch.randint(0, 8, (5, 2), dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu")
        triton_experts.moe_align(ids, 16, 8, None, buffers={"unused": None})
    assert calls == [(16, 8)]
    assert triton_experts.moe_align is shipped
    with align_time.forward_alignment(align_module):
        assert triton_experts.moe_align is shipped


def test_align_time_check_refuses_a_version_that_differs_from_the_oracle():
    from moe_modular.kernels import moe_align as align_module
    from tools.experiments import align_time

    ids = torch.randint(0, 16, (40, 4), dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu")
    align_time.check(align_module, ids, 16, 16, "this")

    class LosesARoute:  # the last meaningful entry overwritten
        @staticmethod
        def moe_align(*args, **kwargs):
            sorted_ids, block_expert, npp = align_module.moe_align(*args, **kwargs)
            sorted_ids[int(npp.item()) - 1] = -3
            return sorted_ids, block_expert, npp

    with pytest.raises(RuntimeError, match="moe_align of broken differs from the oracle"):
        align_time.check(LosesARoute, ids, 16, 16, "broken")


def test_align_time_rejects_a_missing_baseline(capsys, tmp_path):
    from tools.experiments import align_time

    with pytest.raises(SystemExit):
        align_time.parse_args(["--smoke", "--baseline", str(tmp_path / "nope.py")])
    assert "--baseline (" in capsys.readouterr().err


def _yard_row(quant, shape, M, experts, graph_us, yard_us=None, flops=2e12):
    return {"quant": quant, "shape": shape, "M": M, "experts": experts, "eager_us": graph_us * 2, "graph_us": graph_us,
            "floor_flops": flops, "yardstick_us": yard_us, "yardstick_scaling": "row-wise" if yard_us else None}


def test_fp8_yardstick_and_bf16_ratio_tables():
    # fp8 cells with a yardstick report useful TFLOP/s, the fraction of the fp8 rate and yardstick / ours; with
    # bf16 cells in the same run, bf16 time / fp8 time per cell (> 1: fp8 faster)
    rows = [_yard_row("fp8-block", "ds", 4096, "triton", 2000.0, yard_us=1000.0),
            _yard_row("fp8-block", "ds", 8, "triton", 50.0),
            _yard_row("bf16", "ds", 4096, "triton", 3000.0), _yard_row("bf16", "ds", 8, "triton", 40.0)]
    q_rows = [r for r in rows if r["quant"] == "fp8-block"]
    lines = bm.yardstick_lines("fp8-block", q_rows, ["triton"], {"fp8_flops": 4e15})
    assert any("row-wise" in ln for ln in lines)
    # 2e12 flops in 2000 us = 1000 TFLOP/s = 0.25 of 4000; the yardstick took half the time
    assert "| ds | 4096 | 1000.0 | 2000 | 1000 (0.25) | 0.50 |" in lines, lines
    assert not any("| ds | 8 |" in ln for ln in lines), "a cell without a yardstick has no row"
    assert bm.yardstick_lines("bf16", rows[2:], ["triton"], {"fp8_flops": 4e15}) == []
    ratio = bm.bf16_ratio_lines("fp8-block", rows, ["triton"], [8, 4096])
    assert "| ds | triton | 0.80 | 1.50 |" in ratio, ratio
    assert bm.bf16_ratio_lines("bf16", rows, ["triton"], [8, 4096]) == []


def test_fp8_yardstick_declines_cells_it_cannot_measure():
    from tools import fp8_yardstick

    class _CpuTimer:
        cuda = False

    assert fp8_yardstick.yardstick_us(4096, 8, 7168, 2048, True, _CpuTimer()) == (None, "no GPU")

    class _GpuTimer:
        cuda = True

    us, why = fp8_yardstick.yardstick_us(8, 8, 7168, 2048, True, _GpuTimer())
    assert us is None and "64 routed rows: below 1024" in why


# ---- tools/experiments/host_python.py -------------------------------------------------------------------
def test_host_python_times_a_stubbed_forward_per_m_in_its_own_process():
    # The kernels' bodies are stubbed process-wide, so the tool runs in a process of its own; every M gets a row
    # with a positive time, and bad arguments are refused by name.
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "tools.experiments.host_python", "-m", "1", "3", "--reps", "3", "--rounds", "2"]
    run = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = re.findall(r"^\| tiny-e16 \| (\d+) \| ([0-9.]+) \|$", run.stdout, re.M)
    assert [int(m) for m, _ in rows] == [1, 3] and all(float(us) > 0 for _, us in rows), run.stdout
    bad = subprocess.run(cmd[:3] + ["--reps", "0"], cwd=root, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--reps (0) must be >= 1" in bad.stderr
