"""The `droidmesh` command line: one click group, one module per command family."""

from __future__ import annotations

import click

from droidmesh.shared.cli.ask import ask
from droidmesh.shared.cli.bench import bench
from droidmesh.shared.cli.demo import demo
from droidmesh.shared.cli.eval import eval_cmd
from droidmesh.shared.cli.profile import profile
from droidmesh.shared.cli.zoo import zoo


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """DroidMesh: reuse one LLM's KV cache in another, recomputing only a critical layer group."""


main.add_command(ask)
main.add_command(bench)
main.add_command(demo)
main.add_command(zoo)
main.add_command(eval_cmd)
main.add_command(profile)

if __name__ == "__main__":
    main()
