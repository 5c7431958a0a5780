"""Model options shared by commands: which model (a zoo name or a checkpoint path, resolved by
`shared.zoo.manifest.resolve_model`), on which device, in which dtype."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.model.device import DEFAULT_DEVICE, DEVICE_ENV, DTYPES
from droidmesh.shared.model.names import WEIGHT_SUFFIXES, ModelRef
from droidmesh.shared.tools.cli.params import device_name
from droidmesh.shared.zoo.manifest import resolve_model

MODEL_HELP = "a zoo model as `droidmesh zoo list` names it (demo/base), or a local checkpoint directory"


def model_arg(_ctx: click.Context | None, param: click.Parameter | None, value: str | None) -> ModelRef | None:
    """click callback: the option's value as a ModelRef; an unknown model is a usage error."""
    if value is None:
        return None
    try:
        ref = resolve_model(value)
    except DroidMeshError as e:
        raise click.BadParameter(str(e), param=param) from None
    # Checked here, before any model loads: transformers would say it later, less plainly.
    if not any(f.suffix in WEIGHT_SUFFIXES for f in Path(ref.path).iterdir()):
        raise click.BadParameter(f"{ref.path} holds no weights (*.safetensors, *.bin)", param=param)
    return ref


def device_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """`--device` (env DM_DEVICE; cpu, cuda, cuda:N) and `--dtype` (default: the device's)."""
    f = click.option("--dtype", type=click.Choice(sorted(DTYPES)), default=None,
                     help="Model dtype (default: bfloat16 on cuda, float32 on cpu).")(f)
    return click.option("--device", envvar=DEVICE_ENV, default=DEFAULT_DEVICE, show_default=True, callback=device_name,
                        help=f"cpu, cuda or cuda:N (env {DEVICE_ENV}).")(f)
