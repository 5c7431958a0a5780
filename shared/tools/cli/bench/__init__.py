"""`droidmesh bench ...`: benchmark suites, each printing a table and writing --json (and --plot
where it plots). One small module per family of suites, each listing its `COMMANDS`; the work is
in `shared/tools/bench/` and the figures' output in `shared/report.py`."""

from __future__ import annotations

import click

from droidmesh.shared.tools.cli.bench import codecs, data_plane, engine, hosts, load, lora_serving, mesh, peer, screen, vllm


@click.group()
def bench() -> None:
    """Benchmark suites: each prints a table and writes --json (and --plot where it plots)."""


for _family in (engine, load, codecs, mesh, lora_serving, data_plane, hosts, peer, vllm, screen):
    for _command in _family.COMMANDS:
        bench.add_command(_command)
