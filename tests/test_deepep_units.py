"""DeepEP pieces that need no backend: rank-count rules, hidden-size padding and rounding, buffer
configs, import gating and the skip reasons the classes give (deep_ep is not installed here, and
this machine has no CUDA)."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from all2all import deepep
from all2all.base import resolve_backend
from moe_modular.config import ExpertPlacement, MoEConfig, ParallelConfig
from moe_modular.prepare_finalize.deepep_common import linear_expert_table, pad_hidden, to_linear_ids
from moe_modular.prepare_finalize.deepep_ht_prepare_and_finalize import DeepEPHTPrepareAndFinalize
from moe_modular.prepare_finalize.deepep_ll_prepare_and_finalize import DeepEPLLPrepareAndFinalize
from moe_modular.prepare_finalize.ep_common import ExpertPlacementTables
from moe_modular.quant import QuantConfig

HAVE_DEEP_EP = deepep.load_deep_ep() is not None


def _moe(ep=2, rank=0, E=8, topk=2, K=128, dtype=torch.bfloat16, quant=QuantConfig(), placement=ExpertPlacement.LINEAR,
         max_tokens=16):
    return MoEConfig(num_experts=E, topk=topk, hidden_dim=K, intermediate_dim=32, dtype=dtype, quant=quant,
                     parallel=ParallelConfig(ep, rank, placement), max_num_tokens=max_tokens)


# ---- rank counts --------------------------------------------------------------------------------
HT_RANK_CASES = [
    (1, False),   # a single rank: no intranode kernel for it
    (2, True),    # smallest intranode set
    (3, False),   # odd count inside a node
    (4, True),
    (6, False),   # even but not a power of two
    (8, True),    # a full NVLink domain
    (12, False),  # spans nodes but is not 8 x nodes
    (16, True),   # 2 nodes
    (24, True),   # 3 nodes
    (40, False),  # 5 nodes: no internode kernel
    (96, True),   # 12 nodes
    (144, True),  # 18 nodes
    (168, False), # 21 nodes
]


@pytest.mark.parametrize("ranks,ok", HT_RANK_CASES)
def test_ht_rank_counts(ranks, ok):
    err = deepep.ht_rank_count_error(ranks)
    assert (err is None) == ok
    if not ok:
        assert f"ep_size ({ranks})" in err
        assert "[2, 4, 8]" in err  # the intranode set is always listed


LL_RANK_CASES = [
    (1, True),    # one rank: a Buffer over one rank is allowed
    (3, True),    # below one NVLink domain any count
    (7, True),
    (8, True),
    (12, False),  # above 8 only multiples of 8
    (24, True),
]


@pytest.mark.parametrize("ranks,ok", LL_RANK_CASES)
def test_ll_rank_counts(ranks, ok):
    err = deepep.ll_rank_count_error(ranks)
    assert (err is None) == ok
    if not ok:
        assert f"ep_size ({ranks})" in err and "multiple of 8" in err


def test_ht_check_config_names_the_allowed_rank_set():
    err = DeepEPHTPrepareAndFinalize.check_config(_moe(ep=3, E=9, rank=1))
    assert err.startswith("ep_size (3)") and "allowed: [2, 4, 8]" in err


# ---- hidden sizes ---------------------------------------------------------------------------------
HT_PAD_CASES = [
    (2880, (2,), 3072),     # bf16 rows: multiples of 256 elements
    (2880, (1, 2), 3072),   # fp8 rows too: multiples of 512 elements
    (256, (2,), 256),       # already aligned: unchanged
    (256, (1, 2), 512),     # aligned for bf16 but not for fp8
    (1, (2,), 256),         # tiny hidden
    (7168, (1, 2), 7168),   # DeepSeek-V3 hidden, aligned for both
    (4097, (2,), 4352),     # one past a multiple
]


@pytest.mark.parametrize("hidden,sizes,expected", HT_PAD_CASES)
def test_ht_padded_hidden(hidden, sizes, expected):
    got = deepep.ht_padded_hidden(hidden, sizes)
    assert got == expected
    for s in sizes:
        assert (got * s) % deepep.HT_ROW_ALIGN_BYTES == 0


def test_ht_pf_pads_for_its_dispatch_dtype():
    assert DeepEPHTPrepareAndFinalize.padded_hidden_size(_moe(K=2880)) == 3072
    assert DeepEPHTPrepareAndFinalize.padded_hidden_size(_moe(K=256, quant=QuantConfig.fp8_block())) == 512
    # per-token schemes travel in bf16 and quantize after the dispatch
    assert DeepEPHTPrepareAndFinalize.padded_hidden_size(_moe(K=256, quant=QuantConfig.fp8_per_token())) == 256


LL_HIDDEN_CASES = [
    (1, 2048),      # tiny hidden rounds up to the smallest kernel
    (2048, 2048),   # exact kernel size
    (2049, 2560),   # one past a size
    (2880, 3072),   # gpt-oss style hidden
    (7168, 7168),
    (8192, 8192),   # the largest
]


@pytest.mark.parametrize("hidden,expected", LL_HIDDEN_CASES)
def test_ll_hidden_rounding(hidden, expected):
    assert deepep.ll_hidden_size(hidden) == expected


def test_ll_hidden_above_largest_is_a_clear_error():
    with pytest.raises(ValueError) as exc:
        deepep.ll_hidden_size(8193)
    msg = str(exc.value)
    assert "hidden_dim (8193)" in msg and "8192" in msg and "2048" in msg
    assert DeepEPLLPrepareAndFinalize.check_config(_moe(K=8193)).startswith("hidden_dim (8193)")


LL_CONFIG_CASES = [
    (dict(topk=11, E=16), None),                # the largest top-k the kernels take
    (dict(topk=12, E=16), "topk (12)"),         # above it
    (dict(ep=1, E=1, topk=1), "num_experts (1) must be >= 2"),  # the dispatch kernel needs two experts
    (dict(ep=1, E=2, topk=1, max_tokens=1), None),  # one token per rank: the buffer rounds it up
    (dict(dtype=torch.float16), "dtype"),       # bf16 only
    (dict(ep=12, E=24), "ep_size (12)"),        # not a Buffer rank count
]


@pytest.mark.parametrize("kw,fragment", LL_CONFIG_CASES)
def test_ll_check_config(kw, fragment):
    err = DeepEPLLPrepareAndFinalize.check_config(_moe(**kw))
    if fragment is None:
        assert err is None
    else:
        assert fragment in err


LL_TOKEN_CASES = [
    (1, 1, 4),    # one rank: tokens per rank a multiple of 4
    (5, 2, 6),    # two ranks: even
    (6, 2, 6),
    (3, 4, 3),    # four ranks or more: any count
    (7, 8, 7),
    (9, 6, 10),   # six ranks: even
]


@pytest.mark.parametrize("tokens,ranks,expected", LL_TOKEN_CASES)
def test_ll_dispatch_tokens_make_whole_tma_rows(tokens, ranks, expected):
    got = deepep.ll_dispatch_tokens(tokens, ranks)
    assert got == expected and (got * ranks) % deepep.LL_TOKEN_MULTIPLE == 0


def test_ll_qp_depth_bounds_the_tokens_per_rank():
    assert deepep.ll_max_tokens_for_qp_depth(deepep.LL_DEFAULT_QP_DEPTH) == 511
    assert deepep.ll_qp_depth_error(511, 1024) is None
    err = deepep.ll_qp_depth_error(512, 1024)
    assert "max_num_tokens (512 per rank" in err and "<= 511" in err and "NVSHMEM_QP_DEPTH to at least 1026" in err
    assert deepep.ll_qp_depth_error(512, 1026) is None


def test_ll_pf_reports_the_rounded_tokens_per_rank():
    # the experts size their slots from the PF's tokens per rank: the buffer's, rounded up for DeepEP's TMA copies
    class _Manager:
        world_size, rank, group, device = 1, 0, None, torch.device("cpu")

        def dispatch_accepts(self, name):
            return True

        def get_handle(self, config):
            self.config = config
            return None

    manager = _Manager()
    pf = DeepEPLLPrepareAndFinalize(_moe(ep=1, E=4, K=2048, max_tokens=5), manager)
    assert pf.max_num_tokens_per_rank() == 8 and manager.config.max_dispatch_tokens_per_rank == 8


HT_CONFIG_CASES = [
    (dict(dtype=torch.float32), "dtype"),       # the HT combine is bf16 only
    (dict(topk=33, E=64), "topk (33)"),         # above the kernels' 32
    (dict(topk=32, E=64), None),                # at it
]


@pytest.mark.parametrize("kw,fragment", HT_CONFIG_CASES)
def test_ht_check_config(kw, fragment):
    err = DeepEPHTPrepareAndFinalize.check_config(_moe(**kw))
    if fragment is None:
        assert err is None
    else:
        assert fragment in err


def test_pad_hidden_keeps_values_and_zero_fills():
    x = torch.randn(3, 5, 7)
    y = pad_hidden(x, 16)
    assert y.shape == (3, 5, 16) and torch.equal(y[..., :7], x) and not y[..., 7:].any()
    assert pad_hidden(x, 7).data_ptr() == x.data_ptr()
    with pytest.raises(ValueError, match="padded hidden"):
        pad_hidden(x, 6)


# ---- DeepEP's contiguous expert numbering --------------------------------------------------------
@pytest.mark.parametrize("placement", [ExpertPlacement.LINEAR, ExpertPlacement.ROUND_ROBIN])
def test_linear_ids_land_on_the_owning_rank_at_the_local_index(placement):
    E, W = 12, 3
    El = E // W
    tables = ExpertPlacementTables.build(_moe(ep=W, E=E, placement=placement), torch.device("cpu"))
    lin = linear_expert_table(tables)
    assert sorted(lin.tolist()) == list(range(E))  # a permutation
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, E, (9, 3), generator=g)
    ids[0, 1] = -1  # no route stays no route
    mapped = to_linear_ids(lin, ids)
    assert mapped.dtype == torch.int64 and mapped[0, 1] == -1
    for r in range(W):
        # What DeepEP hands rank r: id - r*El where it owns the expert, else -1; it must be the local index.
        recv_local = torch.where((mapped >= r * El) & (mapped < (r + 1) * El), mapped - r * El, torch.full_like(mapped, -1))
        assert torch.equal(recv_local, tables.local_on(ids, r))


# ---- buffer configs ------------------------------------------------------------------------------
def test_buffer_config_validation():
    with pytest.raises(ValueError, match=r"hidden_bytes \(100\)"):
        deepep.DeepEPHTBufferConfig(100)
    with pytest.raises(ValueError, match=r"hidden \(3000\) must be one of"):
        deepep.DeepEPLLBufferConfig(128, 3000, 8)
    with pytest.raises(ValueError, match=r"max_dispatch_tokens_per_rank \(0\)"):
        deepep.DeepEPLLBufferConfig(0, 2048, 8)
    assert deepep.DeepEPLLBufferConfig(128, 2048, 8) == deepep.DeepEPLLBufferConfig(128, 2048, 8)


# ---- import gate and skip reasons ----------------------------------------------------------------
@pytest.mark.skipif(HAVE_DEEP_EP, reason="deep_ep is installed here")
@pytest.mark.parametrize("pf", [DeepEPHTPrepareAndFinalize, DeepEPLLPrepareAndFinalize])
def test_without_deep_ep_the_classes_say_so(pf):
    assert pf.supports(_moe()) == (False, "deep_ep is not installed")
    assert pf.requires_distributed()
    assert deepep.DeepEPHighThroughputManager.supports() == (False, "deep_ep is not installed")
    assert deepep.DeepEPLowLatencyManager.supports() == (False, "deep_ep is not installed")
    # the registry still resolves the names (the module imports without deep_ep)
    assert resolve_backend("deepep_high_throughput") is deepep.DeepEPHighThroughputManager
    assert resolve_backend("deepep_low_latency") is deepep.DeepEPLowLatencyManager


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_with_deep_ep_but_no_cuda_the_reason_is_cuda(monkeypatch):
    stand_in = types.ModuleType("deep_ep")
    stand_in.Buffer = type("Buffer", (), {"low_latency_dispatch": lambda self, x, topk_idx, use_fp8=True: None})
    monkeypatch.setitem(sys.modules, "deep_ep", stand_in)
    ok, reason = DeepEPHTPrepareAndFinalize.supports(_moe())
    assert not ok and "CUDA is not available" in reason
    # config errors come before the missing GPU
    ok, reason = DeepEPHTPrepareAndFinalize.supports(_moe(ep=3, E=9))
    assert not ok and reason.startswith("ep_size (3)")
    ok, reason = DeepEPLLPrepareAndFinalize.supports(_moe(K=9000))
    assert not ok and reason.startswith("hidden_dim (9000)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_first_release_deep_ep_refuses_bf16_low_latency_dispatch(monkeypatch):
    """A deep_ep whose low_latency_dispatch has no use_fp8 always sends fp8: only fp8 1x128 schemes fit."""
    stand_in = types.ModuleType("deep_ep")
    stand_in.Buffer = type("Buffer", (), {"low_latency_dispatch": lambda self, x, topk_idx: None})
    monkeypatch.setitem(sys.modules, "deep_ep", stand_in)
    assert not deepep.ll_dispatch_has_use_fp8()
    assert DeepEPLLPrepareAndFinalize.dispatches_fp8(QuantConfig.fp8_block((128, 128)))
    assert not DeepEPLLPrepareAndFinalize.dispatches_fp8(QuantConfig.fp8_block((64, 64)))
    assert not DeepEPLLPrepareAndFinalize.dispatches_fp8(QuantConfig.fp8_per_token())
