"""Reports: what benchmarks, apps, audits and profiles print and write — a machine record, a
printed table, JSON, and plots (`pyplot`).

Plots print their values (`label_bars`, `label_points`): a bar or point at zero then reads as
a measured zero, not as missing data, and a reader can quote a figure without the JSON."""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    """What the numbers were measured on (stored with every JSON)."""
    import torch  # here, not at import: the CLI loads this module for every command

    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def model_record(adapter: Any) -> dict[str, Any]:
    return {
        "name": adapter.name,
        "layers": adapter.num_layers,
        "hidden": adapter.fingerprint.hidden_size,
        "params": sum(p.numel() for p in adapter.model.parameters()),
        "dtype": str(adapter.dtype).removeprefix("torch."),
    }


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A plain fixed-width table (pasted into the docs as is)."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def write_json(path: str | os.PathLike | None, payload: dict[str, Any]) -> None:
    """Whole or not at all: a long bench rewrites its JSON after each step, and a run killed while
    writing must leave the last one readable (`--resume` reads it back)."""
    if path is None:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    part = p.with_name(f".{p.name}.{os.getpid()}.part")
    part.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(part, p)


def label_bars(ax: Any, bars: Any, fmt: str = "{:.2f}") -> None:
    """Write each bar's value at its end (horizontal or vertical bars)."""
    ax.bar_label(bars, labels=[fmt.format(v) for v in bars.datavalues], fontsize=6, padding=2)


def label_points(ax: Any, xs: Sequence[float], ys: Sequence[float | None], fmt: str = "{:.3g}") -> None:
    """Write each point's y value just above it (None: a point that was not measured, left out)."""
    for x, y in zip(xs, ys, strict=True):
        if y is not None and math.isfinite(y):
            ax.annotate(fmt.format(y), (x, y), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=6)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display), imported at the first plot
    so that a table or JSON alone never pays for matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
