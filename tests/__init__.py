"""The moe-modular test suite and the combinations-matrix command line.

Without a CUDA device, Triton kernels run in Triton's interpreter. That choice must be made before a
kernel module is imported, so the test package makes it here, for pytest and `python -m tests....`
(moe_modular/testing/triton_interpreter.py).
"""
from moe_modular.testing.triton_interpreter import use_interpreter_without_gpu

use_interpreter_without_gpu()
