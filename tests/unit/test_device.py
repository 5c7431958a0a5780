"""Device and dtype names: checked without CUDA, resolved with a one-line error where it is absent."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.model.device import (
    DTYPES,
    check_device_name,
    default_dtype_name,
    dtype_name,
    resolve_device,
    resolve_dtype,
    same_device,
)


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_names_are_accepted(name):
    """cpu, cuda and cuda:N pass the name check without touching CUDA."""
    assert check_device_name(name) == name


@pytest.mark.parametrize("name", ["gpu", "cuda:", "CUDA", "cuda:x", "meta", "cpu:0 "])
def test_other_device_names_are_config_errors(name):
    """Anything else is a ConfigError that lists the accepted forms."""
    with pytest.raises(ConfigError, match="expected cpu, cuda or cuda:N"):
        check_device_name(name)


def test_cpu_resolves():
    """'cpu' is the CPU device."""
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_is_one_line(name):
    """A CUDA device where there is none is a one-line ConfigError naming it."""
    with pytest.raises(ConfigError, match=f"device '{name}': CUDA is not available") as info:
        resolve_device(name)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cuda", torch.bfloat16), ("cuda:3", torch.bfloat16)])
def test_default_dtype_follows_the_device(device, dtype):
    """No dtype: bfloat16 on CUDA, float32 on the CPU; a name or dtype given wins."""
    assert resolve_dtype(None, device) == dtype
    assert getattr(torch, default_dtype_name(device)) == dtype
    assert resolve_dtype("float16", device) == torch.float16
    assert resolve_dtype(torch.float32, device) == torch.float32


def test_dtype_names_round_trip():
    """Every table entry's name survives dtype -> name -> dtype; an unknown name is a ConfigError."""
    for name in DTYPES:
        assert dtype_name(resolve_dtype(name)) == name
    with pytest.raises(ConfigError, match="dtype 'float8'"):
        resolve_dtype("float8")


def test_same_device_compares_type_and_index():
    """Devices are one when type and index agree (cpu is not meta, cuda:0 is not cuda:1)."""
    assert same_device("cpu", torch.device("cpu"))
    assert same_device("meta", torch.empty(0, device="meta").device)
    assert not same_device("cpu", "meta")
    assert not same_device("cuda:0", "cuda:1")
    assert not same_device("cpu", "cuda:0")


def test_checking_names_loads_no_torch():
    """Device and dtype names are checked without importing torch (a CLI command starts fast)."""
    code = ("import sys; from droidmesh.shared.model.device import check_device_name, DTYPES, default_dtype_name; "
            "check_device_name('cuda:1'); default_dtype_name('cuda'); import droidmesh.shared.tools.cli.main; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
