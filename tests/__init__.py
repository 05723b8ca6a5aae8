"""The moe-modular test suite and the combinations-matrix command line.

Without a CUDA device, Triton kernels run in Triton's interpreter; that flag must be set before
triton is first imported, so the suite (and `python -m tests....`) sets it here when unset.
"""
import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
