"""Host-side helpers for kernel launches (plain Python: called on every forward)."""
from __future__ import annotations

import functools

import torch


class BoundedCache(dict):
    """A dict of host-side results by key that starts over past `limit` keys (`put`, `get_or_make`), so a server
    seeing many problem sizes does not grow it without end; a key dropped is made again on its next use."""

    def __init__(self, limit: int = 4096) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key, value) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[key] = value

    def get_or_make(self, key, make):
        item = self.get(key)
        if item is None:
            item = make()
            self.put(key, item)
        return item


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


# Triton releases the Gluon kernels (moe_gemm_ws.py, moe_gemm_ws_fp8.py) were compiled and run on; Gluon is
# experimental and its API moves between releases.
GLUON_CHECKED_TRITON = ("3.6",)


def triton_release_checked(triton_version: str, checked: tuple[str, ...], warning: str) -> bool:
    """Whether `triton_version`'s major.minor is in `checked`; where not, warns `warning` (callers memoize the
    answer per version, so each warns once)."""
    if ".".join(triton_version.split(".")[:2]) in checked:
        return True
    import warnings

    warnings.warn(warning, RuntimeWarning, stacklevel=4)
    return False


@functools.lru_cache(maxsize=None)
def gluon_kernels_enabled(triton_version: str) -> bool:
    """Whether LaunchOptions.ws runs the Gluon kernels under this Triton (major.minor in GLUON_CHECKED_TRITON); elsewhere the
    Triton kernel runs with the same values, and one warning says so."""
    return triton_release_checked(
        triton_version, GLUON_CHECKED_TRITON,
        f"LaunchOptions.ws: the warp-specialized Gluon kernels are checked on Triton {list(GLUON_CHECKED_TRITON)}; "
        f"Triton {triton_version} runs the Triton kernel instead (same values)")
