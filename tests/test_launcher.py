"""moe_modular/kernels/launcher.py: the direct launch path keys compiled kernels by what Triton specializes
on, and launches the same kernels Triton's own path would.

CPU: the key against Triton's own specialization function, the modes' errors, the interpreter fallback.
GPU (skipped without CUDA): TritonExperts forwards under the three launch modes, bitwise equal, with
aligned and misaligned inputs; "check" asks Triton for its cache key on every launch.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl

from moe_modular.kernels import launcher
from moe_modular.kernels.launcher import LAUNCH_MODES, arg_kind, launch, launch_mode

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _triton_spec(v):
    """Triton's own specialization of a runtime argument (type string, attribute)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    return native_specialize_impl(CUDABackend, v, False, True, True)


def _sample_values() -> list:
    base = torch.empty(64, dtype=torch.float32)
    vals: list = [0, 1, 2, 15, 16, 17, 48, -1, -16, -17, 2**31 - 1, 2**31 - 16, 2**31, 2**31 + 16, 2**40, 2**63, 2**63 + 16, 2**64 - 16, -(2**31),
                  -(2**31) - 16, True, False, None, 0.5, 3.0]
    vals += [base, base[1:], base[4:], base[3:]]  # 16-byte aligned and not
    vals += [torch.empty(8, dtype=d) for d in (torch.bfloat16, torch.float16, torch.int32, torch.float8_e4m3fn)]
    vals += [torch.empty(16, dtype=torch.bfloat16)[1:]]
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - triton 3.6 has it
        return vals
    for dtype, block in ((torch.bfloat16, [16, 32]), (torch.bfloat16, [32, 32]), (torch.float16, [16, 32])):
        t = torch.empty(64, 64, dtype=dtype)
        vals.append(TensorDescriptor(t, list(t.shape), list(t.stride()), block))
    return vals


def test_arg_kind_is_at_least_as_fine_as_tritons_specialization():
    """Two arguments with one key must get one specialization from Triton (else a kept kernel could serve
    arguments Triton would compile differently); the key also separates what Triton separates."""
    vals = _sample_values()
    kinds = [arg_kind(v) for v in vals]
    specs = [_triton_spec(v) for v in vals]
    for (ka, sa, va), (kb, sb, vb) in itertools.combinations(zip(kinds, specs, vals), 2):
        if ka == kb:
            assert sa == sb, f"one key {ka} for {va!r} and {vb!r}, but Triton specializes them as {sa} and {sb}"
    assert len(set(kinds)) >= len({repr(s) for s in specs})


def test_arg_kinds_of_a_launch_equal_arg_kind_of_each_argument(monkeypatch):
    # launch() keys on arg_kinds (common types inline, int kinds memoized): the same kinds as arg_kind, also
    # when the memo was cleared on the way (a limit of 3 entries) and when it holds every value already
    monkeypatch.setattr(launcher, "_INT_KINDS", {})
    monkeypatch.setattr(launcher, "_INT_KINDS_LIMIT", 3)
    vals = _sample_values()
    want = tuple(arg_kind(v) for v in vals)
    assert launcher.arg_kinds(tuple(vals)) == want
    assert len(launcher._INT_KINDS) <= 3
    monkeypatch.setattr(launcher, "_INT_KINDS_LIMIT", 4096)
    assert launcher.arg_kinds(tuple(vals)) == want and launcher.arg_kinds(tuple(vals)) == want


def test_arg_kind_rejects_unknown_types():
    with pytest.raises(TypeError, match="no known specialization"):
        arg_kind([1, 2])


def test_launch_mode_names_the_allowed_modes():
    with pytest.raises(ValueError, match=r"launch mode \('fast'\) must be one of \('direct', 'triton', 'check'\)"):
        with launch_mode("fast"):
            pass
    with launch_mode("triton"):
        assert launcher._MODE.get() == "triton"
    assert launcher._MODE.get() in LAUNCH_MODES


def test_environment_mode_is_checked(monkeypatch):
    monkeypatch.setenv("MOE_MODULAR_LAUNCH", "fast")
    with pytest.raises(ValueError, match=r"MOE_MODULAR_LAUNCH \('fast'\) must be one of"):
        launcher._env_mode()
    monkeypatch.setenv("MOE_MODULAR_LAUNCH", "check")
    assert launcher._env_mode() == "check"


def test_launch_hooks_are_seen_only_when_set():
    """triton 3.6 keeps an (empty) HookChain in knobs.runtime.launch_enter_hook instead of None; only a hook that
    would run sends launches down Triton's path (older Triton: a callable or None)."""
    from triton import knobs

    def hook(metadata):
        return None

    assert not launcher._hook_set(None)
    assert launcher._hook_set(hook)
    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip(f"this Triton ({triton.__version__}) keeps no HookChain in knobs.runtime")
    assert not launcher._hooked(), "no launch hook is set, yet launches would take Triton's path"
    chain.add(hook)
    try:
        assert launcher._hooked()
    finally:
        chain.remove(hook)
    assert not launcher._hooked()


class _FakeDriverLauncher:
    """Stands in for triton 3.6's CudaLauncher: its launch function records what it is given."""

    def __init__(self, global_scratch_size: int = 0, profile_scratch_size: int = 0) -> None:
        self.calls: list[tuple] = []
        self.launch = lambda *a: self.calls.append(a)
        self.launch_cooperative_grid, self.launch_pdl, self.num_ctas = False, True, 1
        self.global_scratch_size, self.profile_scratch_size = global_scratch_size, profile_scratch_size
        self.global_scratch_align = self.profile_scratch_align = 1


def test_direct_launch_only_on_the_triton_it_was_checked_on():
    launcher.direct_launch_enabled.cache_clear()
    try:
        assert launcher.direct_launch_enabled("3.6.0")
        with pytest.warns(RuntimeWarning, match=r"checked on Triton \['3.6'\]; under Triton 3.9.0 every launch"):
            assert not launcher.direct_launch_enabled("3.9.0")
    finally:
        launcher.direct_launch_enabled.cache_clear()


@pytest.mark.skipif(not triton.__version__.startswith("3.6."), reason="checks the launch against triton 3.6's "
                    "CudaLauncher internals (other releases take Triton's own path: direct_launch_enabled)")
def test_bare_launch_passes_what_the_driver_launcher_passes(monkeypatch):
    """A kept kernel without scratch memory is launched through the driver launcher's launch function, with the
    arguments triton 3.6's CudaLauncher.__call__ would pass it; with scratch memory, through __call__ itself."""
    cuda_driver = pytest.importorskip("triton.backends.nvidia.driver")
    import triton.runtime

    run = _FakeDriverLauncher()
    # what Triton's own CudaLauncher.__call__ hands its launch function (no scratch: nothing allocated)
    cuda_driver.CudaLauncher.__call__(run, 3, 1, 1, 77, "function", "packed", None, None, None, "x", 5, 64)
    bare = launcher._bare_launch(run)
    assert bare == (run.launch, False, True)

    class Kernel:  # launch() takes an object with device_caches for a compiled (not interpreted) kernel
        device_caches: dict = {}

    kernel, x = Kernel(), torch.empty(4)
    key = (kernel, 0, (("BLOCK", 64),), launcher.arg_kinds((x, 5)))
    kept = launcher._Kept(run, "function", "packed", (64,), None, bare)
    monkeypatch.setitem(launcher._KEPT, key, kept)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launcher, "_hooked", lambda: False)
    monkeypatch.setattr(triton.runtime, "driver", type("D", (), {"active": type("A", (), {
        "get_current_stream": staticmethod(lambda device: 77)})()})())
    with launch_mode("direct"):
        launch(kernel, (3,), x, 5, BLOCK=64)
    assert len(run.calls) == 2
    want, got = run.calls
    assert got[:13] == want[:13] and got[14:] == want[14:] and got[13] is x, (got, want)

    assert launcher._bare_launch(_FakeDriverLauncher(global_scratch_size=128)) is None
    assert launcher._bare_launch(_FakeDriverLauncher(profile_scratch_size=8)) is None
    assert launcher._bare_launch(object()) is None


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(y_ptr + offs, mask=mask) + alpha * tl.load(x_ptr + offs, mask=mask), mask=mask)


@pytest.mark.parametrize("mode", LAUNCH_MODES)
def test_launch_computes_what_triton_launches(mode):
    """The same kernel, launched repeatedly through launch() (the first launch keeps the kernel, later ones go
    direct on a GPU; the interpreter always takes Triton's path), against the same arithmetic in torch."""
    n = 100
    x = torch.randn(n, device=DEVICE)
    y = torch.randn(n, device=DEVICE)
    want = y.clone()
    with launch_mode(mode):
        for alpha in (0.5, 2.0, -1.0):
            launch(_axpy_kernel, (triton.cdiv(n, 32),), x, y, n, alpha, BLOCK=32)
            want += alpha * x
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not CUDA, reason="the direct path needs a GPU (the interpreter always takes Triton's path)")
def test_constexpr_given_positionally_is_refused():
    x = torch.zeros(8, device=DEVICE)
    with launch_mode("direct"), pytest.raises(TypeError, match="constexpr parameter 'BLOCK' of _axpy_kernel must be "
                                                                  "passed by keyword"):
        launch(_axpy_kernel, (1,), x, x, 8, 1.0, 8)


@pytest.mark.skipif(not CUDA, reason="the direct path needs a GPU (the interpreter always takes Triton's path)")
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("misaligned", [False, True])
def test_forwards_bitwise_equal_across_launch_modes(T, misaligned):
    """TritonExperts through the NoEP PF: the direct launches compute bit for bit what Triton's launches do, and
    "check" finds Triton's cache key equal to the kept kernel's on every launch. Misaligned: the tokens start 2
    bytes into their storage (another specialization of the activation pointer)."""
    from moe_modular.config import MoEConfig
    from moe_modular.experts.triton_experts import TritonExperts
    from moe_modular.kernels.moe_gemm import _moe_gemm_kernel
    from moe_modular.modular_kernel import FusedMoEModularKernel
    from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
    from moe_modular.quant import MoEQuantParams

    E, K, N, topk = 16, 256, 128, 4
    moe = MoEConfig(num_experts=E, topk=topk, hidden_dim=K, intermediate_dim=N, dtype=torch.bfloat16,
                    max_num_tokens=T)
    pf = MoEPrepareAndFinalizeNoEP.make(moe)
    mk = FusedMoEModularKernel(pf, TritonExperts(moe, MoEQuantParams()))
    w1 = torch.randn(E, 2 * N, K, device=DEVICE).div_(K ** 0.5).bfloat16()
    w2 = torch.randn(E, K, N, device=DEVICE).div_(N ** 0.5).bfloat16()
    store = torch.randn(T * K + 1, device=DEVICE).bfloat16()
    x = (store[1:] if misaligned else store[:-1]).view(T, K)
    assert (x.data_ptr() % 16 != 0) == misaligned
    logits = torch.randn(T, E, device=DEVICE)
    tw, ti = torch.topk(torch.softmax(logits, -1), topk)
    tw, ti = (tw / tw.sum(-1, keepdim=True)).float(), ti.int()
    outs = {}
    for mode in ("triton", "direct", "check", "direct"):
        out = torch.full_like(x, float("nan"))
        with launch_mode(mode):
            for _ in range(2):  # the first launch of a key keeps the kernel, the second goes direct
                out.fill_(float("nan"))
                mk(x, w1, w2, tw, ti, output=out)
        torch.cuda.synchronize()
        outs.setdefault(mode, out)
        assert torch.equal(out, outs["triton"]), f"{mode} launches differ from Triton's"
    assert not torch.isnan(outs["triton"]).any()
    assert any(key[0] is _moe_gemm_kernel and kept is not None for key, kept in launcher._KEPT.items()), \
        "no grouped GEMM launch was kept for direct launches"


def test_bounded_cache_starts_over_past_its_limit():
    from moe_modular.kernels import launcher
    from moe_modular.kernels.host import BoundedCache

    assert isinstance(launcher._KEPT, BoundedCache)  # the kept kernels are bounded
    kept = BoundedCache(limit=3)
    for i in range(7):
        kept.put(("key", i), None)
        assert len(kept) <= 3
    assert kept.get(("key", 6), "missing") is None and kept.get(("key", 0), "missing") == "missing"
    made = []
    memo = BoundedCache(limit=2)
    for key in (1, 2, 1, 3, 1):
        memo.get_or_make(key, lambda key=key: made.append(key) or f"plan {key}")
    assert made == [1, 2, 3, 1] and len(memo) <= 2  # 1 made again after the cache started over at 3
