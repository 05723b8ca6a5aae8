"""Triton's interpreter for running the kernels on a CPU, with a fix of its float handling so they compute what
the GPU computes. Nothing happens on import: a command line that may run without a GPU calls
`use_interpreter_without_gpu()` first thing in its main, before it imports any kernel module (Triton reads
TRITON_INTERPRET when a kernel is defined); tests/__init__.py does it for the test suite, and a rank spawned by
`parallel_launch` inherits the choice and applies the fixes before its worker runs.

`patch_triton_interpreter()` fixes four things in triton 3.6's interpreter, all seen with numpy 2:
  1. bf16 values are held as raw uint16 patterns and numpy runs arithmetic, comparisons, tl.dot
     and min/max on the patterns: convert through torch to float32, compute, round back.
  2. float32 -> bf16 casts truncate: round to nearest even, as the GPU does.
  3. float -> fp8 casts drop the rounding carry (126.2 -> 64 in e4m3): convert through torch,
     saturating at the format's largest finite value (the GPU's satfinite conversion).
  4. a scalar kernel argument is a 1-element array, and `range(n)` over it fails with
     "only 0-dimensional arrays can be converted to Python scalars": index through .item().
"""
from __future__ import annotations

import os

import torch


def use_interpreter() -> bool:
    """Run this process's Triton kernels in the interpreter: TRITON_INTERPRET=1 unless the environment
    already says otherwise (it takes effect only before triton is first imported), then the fixes
    below. Returns what patch_triton_interpreter returns."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return patch_triton_interpreter()


def use_interpreter_without_gpu() -> bool:
    """use_interpreter() when this machine has no CUDA device and the environment does not choose; else, where
    the environment already asks for the interpreter, only its fixes. Returns True when the interpreter is on."""
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        return use_interpreter()
    return interpreter_requested() and patch_triton_interpreter()


def interpreter_requested() -> bool:
    """Whether this process's environment asks Triton for its interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def patch_triton_interpreter() -> bool:
    """Apply the fixes above to triton's interpreter (idempotent). Returns True when applied."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    builder_cls = interp.InterpreterBuilder
    if getattr(builder_cls, "_moe_modular_patched", False):
        return True

    torch_of = {
        tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
        tl.float16: torch.float16,
        tl.float32: torch.float32,
        tl.float64: torch.float64,
    }
    bits_of = {1: torch.uint8, 2: torch.uint16}

    def to_f32(data, tl_dtype) -> np.ndarray:
        """Interpreter data of a float tl_dtype -> float32 numpy."""
        t = torch.from_numpy(np.ascontiguousarray(data))
        tdt = torch_of[tl_dtype]
        if t.dtype != tdt:
            t = t.view(tdt)
        return t.float().numpy()

    def from_f32(x, tl_dtype) -> np.ndarray:
        """float numpy -> interpreter data of tl_dtype (round to nearest even, fp8 saturating)."""
        tdt = torch_of[tl_dtype]
        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64 if tl_dtype == tl.float64 else np.float32))
        if tdt in (torch.float8_e4m3fn, torch.float8_e5m2):
            fmax = torch.finfo(tdt).max
            t = t.clamp(-fmax, fmax)
        t = t.to(tdt)
        if t.element_size() in bits_of and tdt not in (torch.float16,):
            t = t.view(bits_of[t.element_size()])
        return t.numpy()

    def is_special(tl_dtype) -> bool:
        return tl_dtype in (tl.bfloat16, tl.float8e4nv, tl.float8e5)

    # 2 + 3: casts.
    orig_cast_impl = builder_cls.cast_impl

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if (is_special(s) or is_special(d)) and s in torch_of and d in torch_of:
            return interp.TensorHandle(from_f32(to_f32(src.data, s), d), d)
        return orig_cast_impl(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        s, d = src.dtype.scalar, dst_type.scalar
        return interp.TensorHandle(from_f32(to_f32(src.data, s), d), d)

    builder_cls.cast_impl = cast_impl
    for name in ("create_fp_ext", "create_fp_trunc"):
        setattr(builder_cls, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
    builder_cls.create_fp_to_fp = create_fp_to_fp

    # 1: arithmetic, comparisons, min/max, clamp, unary math and dot on bf16.
    orig_binary = builder_cls.binary_op

    def binary_op(self, lhs, rhs, op):
        t = lhs.dtype.scalar
        if t == tl.bfloat16 and rhs.dtype.scalar == tl.bfloat16:
            out = op(to_f32(lhs.data, t), to_f32(rhs.data, t))
            if out.dtype == np.bool_:
                return interp.TensorHandle(out, t)
            return interp.TensorHandle(from_f32(out, t), t)
        return orig_binary(self, lhs, rhs, op)

    builder_cls.binary_op = binary_op
    # The class body bound the lambdas to the original binary_op; rebind the float ones.
    for name, op in (("create_fadd", np.add), ("create_fmul", np.multiply), ("create_fdiv", np.divide),
                     ("create_frem", np.fmod), ("create_fsub", np.subtract), ("create_precise_divf", np.divide),
                     ("create_minimumf", np.minimum), ("create_minnumf", np.minimum),
                     ("create_maximumf", np.maximum), ("create_maxnumf", np.maximum),
                     ("create_fcmpOLT", np.less), ("create_fcmpOGT", np.greater),
                     ("create_fcmpOLE", np.less_equal), ("create_fcmpOGE", np.greater_equal),
                     ("create_fcmpOEQ", np.equal), ("create_fcmpONE", np.not_equal),
                     ("create_fcmpULT", np.less), ("create_fcmpUGT", np.greater),
                     ("create_fcmpULE", np.less_equal), ("create_fcmpUGE", np.greater_equal),
                     ("create_fcmpUEQ", np.equal), ("create_fcmpUNE", np.not_equal)):
        setattr(builder_cls, name, lambda self, lhs, rhs, op=op: self.binary_op(lhs, rhs, op))

    def create_clampf(self, arg, lo, hi, propagate_nans):
        t = arg.dtype.scalar
        if t == tl.bfloat16:
            out = np.clip(to_f32(arg.data, t), to_f32(lo.data, t), to_f32(hi.data, t))
            return interp.TensorHandle(from_f32(out, t), t)
        return self.ternary_op(arg, lo, hi, np.clip)

    builder_cls.create_clampf = create_clampf

    orig_unary = builder_cls.unary_op

    def unary_op(self, arg, op):
        t = arg.dtype.scalar
        if t == tl.bfloat16:
            return interp.TensorHandle(from_f32(op(to_f32(arg.data, t)), t), t)
        return orig_unary(self, arg, op)

    builder_cls.unary_op = unary_op
    for name, op in (("create_cos", np.cos), ("create_exp", np.exp), ("create_exp2", np.exp2),
                     ("create_floor", np.floor), ("create_ceil", np.ceil), ("create_log", np.log),
                     ("create_log2", np.log2), ("create_precise_sqrt", np.sqrt), ("create_sqrt", np.sqrt),
                     ("create_sin", np.sin)):
        setattr(builder_cls, name, lambda self, arg, op=op: self.unary_op(arg, op))

    orig_dot = builder_cls.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        sa, sb = a.dtype.scalar, b.dtype.scalar
        if is_special(sa) or is_special(sb):
            acc = d.data
            out = np.matmul(to_f32(a.data, sa), to_f32(b.data, sb)).astype(acc.dtype) + acc
            return interp.TensorHandle(out, d.dtype.scalar)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot

    # 4: scalar arguments as loop bounds.
    orig_patch_tensor = interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        orig_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patch_lang_tensor
    builder_cls._moe_modular_patched = True
    return True
