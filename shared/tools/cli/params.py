"""Option values every command parses the same way: layer groups, integer lists, devices, the
codecs a plan's size is known for, named shapes, text files.

Each parser raises `click.BadParameter` (or a `BadRequestError` where the check needs what a
command loads later, such as a model's layer count), which `main` prints as one line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from droidmesh.shared.errors import BadRequestError, ConfigError
from droidmesh.shared.model.device import check_device_name

_GROUP = re.compile(r"^\s*\[?\s*(-?\d+)\s*[,:]\s*(-?\d+)\s*\)?\s*$")


class LayerGroup(click.ParamType):
    """A recompute group `[start, end)` written `start:end` or `start,end` (`[4,6)` too);
    a group may start at layer 0 (recomputed from the receiver's own embeddings)."""

    name = "START:END"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        m = _GROUP.match(str(value))
        if m is None:
            self.fail(f"{value!r} is not a layer group; write START:END (e.g. 4:6 for layers [4, 6))", param, ctx)
        start, end = int(m.group(1)), int(m.group(2))
        if start < 0 or end <= start:
            self.fail(f"group {value!r}: need 0 <= START < END (got [{start}, {end}))", param, ctx)
        return start, end


GROUP = LayerGroup()


def check_group(group: tuple[int, int], num_layers: int, what: str = "--group") -> tuple[int, int]:
    """The group, if it fits a model of `num_layers` layers."""
    if group[1] > num_layers:
        raise BadRequestError(f"{what} [{group[0]}, {group[1]}) is out of range: the model has {num_layers} layers")
    return group


def checkpoint_layers(path: str | Path) -> int:
    """A checkpoint's layer count, from its config.json (without loading the weights); a PEFT
    adapter's (no config.json of its own) from its base's."""
    p = Path(path)
    if not (p / "config.json").is_file() and (p / "adapter_config.json").is_file():
        from droidmesh.shared.model.adapter import lora_base  # torch: only adapters pay for the import

        p = lora_base(p) or p
    return int(json.loads((p / "config.json").read_text())["num_hidden_layers"])


def int_list(_ctx: click.Context | None, param: click.Parameter | None, value: str) -> list[int]:
    """click callback: comma-separated positive integers."""
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", param=param) from None
    if not out or min(out) < 1:
        raise click.BadParameter(f"need positive integers, got {value!r}", param=param)
    return out


def float_list(minimum: float = 0.0, open_min: bool = False) -> Callable[[Any, Any, str], list[float]]:
    """click callback factory: comma-separated numbers, each >= `minimum` (> with `open_min`)."""
    def parse(_ctx: click.Context | None, param: click.Parameter | None, value: str) -> list[float]:
        try:
            out = [float(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise click.BadParameter(f"expected comma-separated numbers, got {value!r}", param=param) from None
        if not out or any(v < minimum or (open_min and v == minimum) for v in out):
            raise click.BadParameter(f"need numbers {'>' if open_min else '>='} {minimum:g}, got {value!r}", param=param)
        return out

    return parse


def device_name(_ctx: click.Context | None, param: click.Parameter | None, value: str) -> str:
    """click callback: cpu, cuda or cuda:N (`check_device_name`)."""
    try:
        return check_device_name(value)
    except ConfigError as e:
        raise click.BadParameter(str(e), param=param) from None


RAW_CODECS = ("raw", "int8", "int4")  # codecs whose bytes need no maps or layers to name
SHAPE_NAMES = ("llama3-8b", "qwen2.5-7b", "llama3.2-1b", "smollm2-135m", "tiny")  # shared/model/shapes.py


def raw_codec_list(_ctx: click.Context | None, param: click.Parameter | None, value: str) -> list[str]:
    """click callback: a comma list of `RAW_CODECS`."""
    out = [c.strip() for c in value.split(",") if c.strip()]
    bad = [c for c in out if c not in RAW_CODECS]
    if not out or bad:
        raise click.BadParameter(f"codecs are raw, int8 and int4 (a low-rank code's size depends on its maps), got {value!r}",
                                 param=param)
    return out


def read_text(path: str, what: str = "context") -> str:
    """A UTF-8 text file that holds something: an empty or binary file is a one-line error
    (a receiver would otherwise answer over nothing, or over mojibake)."""
    data = Path(path).read_bytes()
    if not data.strip():
        raise BadRequestError(f"{what} file {path} is empty")
    if b"\x00" in data:
        raise BadRequestError(f"{what} file {path} is binary, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequestError(f"{what} file {path} is not UTF-8 text (byte {e.start})") from None
