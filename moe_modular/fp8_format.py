"""The fp8 number format every scheme uses: e4m3 (torch.float8_e4m3fn), its largest finite value, and the
smallest amax a scale is taken from. A leaf module: the quantization code and the kernels both read it."""
import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
MIN_AMAX = 1e-12  # an all-zero row or group gets the scale of this amax, not 0
