"""Devices and dtypes: the one place a device name or a dtype name becomes a torch object.

Every service and command takes a `device` setting (`--device`, `DM_DEVICE`): `cpu` (the
default), `cuda` or `cuda:N`. The dtype follows the device unless given: bfloat16 on CUDA (what
serving engines run), float32 on the CPU (exact reference numerics, and CPU bf16 matmuls are
slow). Nothing here initialises CUDA at import time; `resolve_device` checks availability.
torch is imported where a torch object is made, not with the module: commands that only check
a name (`droidmesh ask`, service configs) start without loading torch.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from droidmesh.shared.errors import ConfigError

if TYPE_CHECKING:
    import torch

DEVICE_ENV = "DM_DEVICE"
DEFAULT_DEVICE = "cpu"
DTYPES = ("float32", "bfloat16", "float16")  # the dtype names DroidMesh runs in (torch attribute names)
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def check_device_name(name: str) -> str:
    """`name` if it is `cpu`, `cuda` or `cuda:N` (no CUDA needed to check); else `ConfigError`.
    Config classes call it in `__post_init__`, so a typo stops a service before it loads."""
    if not _DEVICE.match(name):
        raise ConfigError(f"device {name!r}: expected cpu, cuda or cuda:N")
    return name


def resolve_device(name: str) -> torch.device:
    """The torch device for `name`; `ConfigError` when it names a GPU this machine lacks."""
    import torch

    check_device_name(name)
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r}: CUDA is not available here (CPU build of torch, or no GPU)")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


def same_device(a: str | torch.device, b: str | torch.device) -> bool:
    """Whether two devices are one: `cuda` (no index) is the current CUDA device, so it equals
    `cuda:N` when N is current (tensors always carry an index, names often do not)."""
    import torch

    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and _index(a) == _index(b)


def _index(device: torch.device) -> int | None:
    if device.type == "cuda" and device.index is None:
        import torch

        return torch.cuda.current_device()  # only reached once a CUDA device is in use
    return device.index


def default_dtype_name(device: str | torch.device) -> str:
    """bfloat16 on CUDA, float32 elsewhere."""
    kind = device.split(":")[0] if isinstance(device, str) else device.type
    return "bfloat16" if kind == "cuda" else "float32"


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the name on the wire and in configs)."""
    return str(dtype).removeprefix("torch.")


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device = DEFAULT_DEVICE) -> torch.dtype:
    """The torch dtype for a name (None or "": the device's default)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or default_dtype_name(device)
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r}: expected one of {sorted(DTYPES)}")
    return getattr(torch, name)
