"""Host-side helpers for kernel launches (plain Python: called on every forward)."""
from __future__ import annotations

import functools

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-int(a) // int(b))


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    x = int(x)
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def gpu_has_tma(device: torch.device) -> bool:
    """Whether `device` is a GPU of compute capability >= 9 (Hopper and later): the tensor memory accelerator,
    and programmatic dependent launch with grid dependency control (griddepcontrol). Asked on every launch, so
    the capability is read once per GPU."""
    if device.type != "cuda":
        return False
    return _capability_major(torch.cuda.current_device() if device.index is None else device.index) >= 9


def pdl_launch(want: bool, device: torch.device) -> dict:
    """The launch keywords of a programmatic dependent launch: {"launch_pdl": True} where it is wanted and
    `device` has it (gpu_has_tma), else none (the interpreter and older GPUs take no such option)."""
    return {"launch_pdl": True} if want and gpu_has_tma(device) else {}


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]
