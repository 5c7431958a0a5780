"""The `droidmesh` command line: one click group, one module per command family.

`Cli.main` is the one place errors become output: a user mistake (a click usage error, or a
`DroidMeshError` / `OSError` / `ValueError` from a command) is one `Error: ...` line on stderr
and exit status 1 (2 for usage errors); anything else is one line too, with a hint to set
DM_DEBUG=1, which re-raises it for the traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import click

from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.tools.cli.agents import agents
from droidmesh.shared.tools.cli.ask import ask, prefill, receivers
from droidmesh.shared.tools.cli.audit import audit
from droidmesh.shared.tools.cli.bench import bench
from droidmesh.shared.tools.cli.config import config
from droidmesh.shared.tools.cli.demo import demo
from droidmesh.shared.tools.cli.eval import eval_cmd, eval_merge
from droidmesh.shared.tools.cli.keys import keys
from droidmesh.shared.tools.cli.nats_auth import nats_auth
from droidmesh.shared.tools.cli.profile import profile
from droidmesh.shared.tools.cli.serve import serve
from droidmesh.shared.tools.cli.zoo import zoo

DEBUG_ENV = "DM_DEBUG"


def one_line(text: str) -> str:
    return " ".join(text.split())


def _fail(message: str, status: int) -> NoReturn:
    click.echo(f"Error: {one_line(message)}", err=True)
    sys.exit(status)


class Cli(click.Group):
    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:  # a caller handling errors itself
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as e:  # click's own text is usage + hint + error: keep the error
            hint = f" (see `{e.ctx.command_path} -h`)" if e.ctx is not None else ""
            _fail(e.format_message() + hint, e.exit_code)
        except click.ClickException as e:
            _fail(e.format_message(), e.exit_code)
        except click.Abort:
            _fail("aborted", 1)
        except (DroidMeshError, OSError, ValueError) as e:
            if debug:
                raise
            _fail(str(e) or type(e).__name__, 1)
        except Exception as e:  # a bug, not a mistake: still one line, the traceback on demand
            if debug:
                raise
            _fail(f"{type(e).__name__}: {e} (unexpected; set {DEBUG_ENV}=1 for the traceback)", 1)
        sys.exit(rv if isinstance(rv, int) else 0)  # an int is click's exit status (--help: 0)


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """DroidMesh: reuse one LLM's KV cache in another, recomputing only a critical layer group."""


for command in (agents, ask, prefill, receivers, audit, config, bench, demo, serve, zoo, eval_cmd, eval_merge, profile, nats_auth,
                keys):
    main.add_command(command)

if __name__ == "__main__":
    main()
