"""Triton kernel launches with less host work per launch (plain Python: called on every forward).

`kernel[grid](*args, **kw)` binds every parameter (~70 for the grouped GEMM), computes each one's
specialization, looks the compiled kernel up, checks the globals it captured and then packs the launch,
on every call. `launch(kernel, grid, *args, **kw)` takes the first launch of each specialization down
Triton's own path (which compiles the kernel or finds it in Triton's cache) and keeps the compiled
kernel under a key of what Triton specializes on:
  - every keyword, by value: the constexprs and the launch options (num_warps, num_stages, launch_pdl);
  - each positional argument's kind: a tensor's dtype and whether its address is 16-byte aligned; an
    int's width (32 or 64 bits, unsigned past int64) and whether it is 1 or a multiple of 16; bool, float
    and None as such; a tensor descriptor's dtype, block shape and padding;
  - the current CUDA device.
Later launches with the same key go to the compiled kernel's launcher directly. Positional arguments
must be the kernel's leading runtime parameters and keywords its constexprs, defaulted parameters
and launch options, so a key fixes every value that is not passed positionally.

Modes (`launch_mode(...)`, default from the environment variable MOE_MODULAR_LAUNCH, else DEFAULT_MODE):
"direct" as above; "triton" every launch through Triton's path; "check" as direct, and each launch also
asks Triton's binder for its cache key and fails unless it is the key the kept kernel was compiled
under (for tests). The interpreter (TRITON_INTERPRET=1) and a set launch hook (knobs.runtime
launch_enter_hook / launch_exit_hook, e.g. a profiler's) always take Triton's path.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from moe_modular.kernels.host import BoundedCache

LAUNCH_MODES = ("direct", "triton", "check")
# direct: passed the GPU tests in "check" mode on triton 3.6 (H100, torch 2.11); "triton" is the fallback
DEFAULT_MODE = "direct"
# Triton releases (major.minor) whose launcher internals the direct launch was checked against; under any
# other release every launch takes Triton's own path, and one warning says so.
DIRECT_CHECKED_TRITON = ("3.6",)
_ENV = "MOE_MODULAR_LAUNCH"


def _env_mode() -> str:
    mode = os.environ.get(_ENV, DEFAULT_MODE)
    if mode not in LAUNCH_MODES:
        raise ValueError(f"{_ENV} ({mode!r}) must be one of {LAUNCH_MODES}")
    return mode


_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("moe_modular_launch_mode", default=_env_mode())


@contextlib.contextmanager
def launch_mode(mode: str) -> Iterator[None]:
    """Launch this context's kernels in `mode` (one of LAUNCH_MODES)."""
    if mode not in LAUNCH_MODES:
        raise ValueError(f"launch mode ({mode!r}) must be one of {LAUNCH_MODES}")
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


_I32_MIN, _I32_MAX, _I64_MAX = -(1 << 31), (1 << 31) - 1, (1 << 63) - 1


def arg_kind(v: Any) -> Any:
    """What Triton specializes a positional argument on (see the module docstring); hashable."""
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() & 15 == 0
    if v is None or isinstance(v, (bool, float)):
        return type(v)
    if isinstance(v, int):
        return _int_kind(v)
    block = getattr(v, "block_shape", None)
    if block is not None and hasattr(v, "base"):  # a host tensor descriptor
        return "desc", v.base.dtype, tuple(block), getattr(v, "padding", None)
    raise TypeError(f"launch: a positional argument of type {type(v).__name__} has no known specialization; "
                    f"allowed: tensors, tensor descriptors, int, float, bool, None")


# Memo of the kinds of int arguments (strides and sizes repeat from launch to launch); cleared past the limit.
_INT_KINDS: dict[int, tuple] = {}
_INT_KINDS_LIMIT = 4096


def _int_kind(v: int) -> tuple:
    """1, a multiple of 16, int32, past int64 (unsigned); remembered in _INT_KINDS."""
    kind = (v == 1, v & 15 == 0, _I32_MIN <= v <= _I32_MAX, v > _I64_MAX)
    if len(_INT_KINDS) >= _INT_KINDS_LIMIT:
        _INT_KINDS.clear()
    _INT_KINDS[v] = kind
    return kind


def arg_kinds(args: tuple) -> tuple:
    """tuple(arg_kind(v) for v in args), with the common types inline and int kinds memoized (this runs for
    every argument of every launch)."""
    get = _INT_KINDS.get
    return tuple([(get(v) or _int_kind(v)) if type(v) is int else
                  (v.dtype, v.data_ptr() & 15 == 0) if type(v) is torch.Tensor else arg_kind(v) for v in args])


@dataclass(frozen=True)
class _Kept:
    """A compiled kernel and what a direct launch passes it after the positional arguments."""

    run: Any  # the driver launcher (CompiledKernel.run)
    function: Any
    packed_metadata: Any
    tail: tuple  # the values of the parameters after the positional ones (keywords and defaults)
    triton_key: Optional[str]  # Triton's cache key (None where its internals differ from triton 3.6's)
    # the driver launcher's own launch function and its two flags, where the kernel needs no scratch memory
    # (then run(...) only adds a Python frame before it); None: launch through run
    bare: Optional[tuple] = None


# The compiled kernels kept for direct launches, by launch key; None under a key: that key always takes Triton's
# path (the interpreter). A key dropped past the bound is kept again from Triton's own cache on its next launch.
_KEPT = BoundedCache()  # this process's kernels (compiled kernels are per process, as Triton's own cache is)
_MISSING = object()


@functools.lru_cache(maxsize=None)
def direct_launch_enabled(triton_version: str) -> bool:
    """Whether the direct launch runs under this Triton release (DIRECT_CHECKED_TRITON); warns once where not."""
    from moe_modular.kernels.host import triton_release_checked

    return triton_release_checked(
        triton_version, DIRECT_CHECKED_TRITON,
        f"moe_modular's direct kernel launch is checked on Triton {list(DIRECT_CHECKED_TRITON)}; under "
        f"Triton {triton_version} every launch takes Triton's own path")


def launch(kernel, grid: tuple, *args, **kw) -> None:
    """kernel[grid](*args, **kw), directly where a kernel of the same key ran before (module docstring)."""
    mode = _MODE.get()
    if (mode == "triton" or not hasattr(kernel, "device_caches") or _hooked()  # no device_caches: interpreter
            or not direct_launch_enabled(_triton_version())):
        kernel[grid](*args, **kw)
        return
    device = torch.cuda.current_device()
    key = (kernel, device, tuple(kw.items()), arg_kinds(args))
    kept = _KEPT.get(key, _MISSING)
    if kept is _MISSING:
        _KEPT.put(key, _keep(kernel, grid, args, kw, device))
        return
    if kept is None:
        kernel[grid](*args, **kw)
        return
    if mode == "check":
        _check(kernel, kept, args, kw, device)
    g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
    from triton.runtime import driver

    stream = driver.active.get_current_stream(device)
    if kept.bare is not None:
        call, cooperative, pdl = kept.bare
        call(g0, g1, g2, stream, kept.function, cooperative, pdl, None, None, kept.packed_metadata, None, None, None,
             *args, *kept.tail)
    else:
        kept.run(g0, g1, g2, stream, kept.function, kept.packed_metadata, None, None, None, *args, *kept.tail)


@functools.lru_cache(maxsize=1)
def _triton_version() -> str:
    import triton

    return triton.__version__


def _hooked() -> bool:
    from triton import knobs

    return _hook_set(knobs.runtime.launch_enter_hook) or _hook_set(knobs.runtime.launch_exit_hook)


def _hook_set(hook: Any) -> bool:
    """Whether a launch hook would run: triton 3.6 keeps a HookChain there (never None; set when its list of
    calls is not empty), older Triton a callable or None."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


def _keep(kernel, grid, args: tuple, kw: dict, device: int) -> Optional[_Kept]:
    """Launch through Triton (compiling if needed) and return what later direct launches need, or None
    where the kernel cannot be launched directly (the interpreter)."""
    compiled = kernel[grid](*args, **kw)
    params = getattr(kernel, "params", None)
    if params is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return None
    names = [p.name for p in params]
    lead = params[: len(args)]
    if any(p.is_constexpr for p in lead):
        bad = next(p.name for p in lead if p.is_constexpr)
        raise TypeError(f"launch: constexpr parameter {bad!r} of {kernel.__name__} must be passed by keyword")
    tail = []
    for p in params[len(args):]:
        if p.name in kw:
            tail.append(kw[p.name])
        elif p.has_default:
            tail.append(p.default)
        else:
            raise TypeError(f"launch: parameter {p.name!r} of {kernel.__name__} is missing")
        if not p.is_constexpr and p.name in kw and isinstance(kw[p.name], torch.Tensor):
            raise TypeError(f"launch: runtime parameter {p.name!r} of {kernel.__name__} must be passed positionally")
    extra = [k for k in kw if k in names[: len(args)]]
    if extra:
        raise TypeError(f"launch: {extra} of {kernel.__name__} given both positionally and by keyword")
    run = compiled.run
    return _Kept(run, compiled.function, compiled.packed_metadata, tuple(tail), _triton_key(kernel, args, kw, device),
                 _bare_launch(run))


def _bare_launch(run) -> Optional[tuple]:
    """(launch, launch_cooperative_grid, launch_pdl) of a triton 3.6 CudaLauncher whose kernel needs no global or
    profile scratch memory: what its __call__ passes on after allocating none; None otherwise (other Triton
    versions, or scratch to allocate per launch)."""
    names = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size", "profile_scratch_size")
    if not all(hasattr(run, n) for n in names) or run.global_scratch_size or run.profile_scratch_size:
        return None
    return run.launch, run.launch_cooperative_grid, run.launch_pdl


def _triton_key(kernel, args: tuple, kw: dict, device: int) -> Optional[str]:
    """The cache key Triton's own launch path computes for these arguments (None where Triton's internals
    are not those of triton 3.6: its binder per device and compute_cache_key)."""
    from triton import knobs

    try:
        from triton.runtime.jit import compute_cache_key

        _, key_cache, _, _, binder = kernel.device_caches[device]
    except (ImportError, AttributeError, KeyError, ValueError, TypeError):
        return None
    kw = dict(kw, debug=kw.get("debug", kernel.debug) or knobs.runtime.debug,
              instrumentation_mode=knobs.compilation.instrumentation_mode)
    _, specialization, options = binder(*args, **kw)
    return compute_cache_key(key_cache, specialization, options)


def _check(kernel, kept: _Kept, args: tuple, kw: dict, device: int) -> None:
    key = _triton_key(kernel, args, kw, device)
    if key is None or key != kept.triton_key:
        raise RuntimeError(f"launch: {kernel.__name__} would be launched with a kernel compiled for another "
                           f"specialization (Triton's key {key} against {kept.triton_key})")
