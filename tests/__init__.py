"""The moe-modular test suite and the combinations-matrix command line.

Without a CUDA device, Triton kernels run in Triton's interpreter. That flag must be set before
triton is first imported, and the interpreter's float handling needs a fix
(tests/triton_interpreter_patch.py); both happen here, in every process that imports the test
package: pytest, `python -m tests....`, the tools that reuse the matrix, and spawned ranks.
"""
import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.triton_interpreter_patch import patch_triton_interpreter

    patch_triton_interpreter()
