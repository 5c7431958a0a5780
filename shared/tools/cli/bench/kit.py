"""What the `droidmesh bench` suites' commands share: the device option of suites that launch
services, the zoo's demo pair they measure, and how a suite's JSON is written."""

from __future__ import annotations

import click

from droidmesh.shared import report
from droidmesh.shared.model.device import DEFAULT_DEVICE, DEVICE_ENV
from droidmesh.shared.tools.cli.params import check_group, checkpoint_layers, device_name


def launched_device_option(f):  # a click decorator
    """`--device` alone, for suites whose services and probe run bfloat16 on any device."""
    return click.option("--device", envvar=DEVICE_ENV, default=DEFAULT_DEVICE, show_default=True, callback=device_name,
                        help=f"cpu, cuda or cuda:N for the launched processes (env {DEVICE_ENV}).")(f)


GROUP_HELP = "Recompute group START:END (layers [START, END); START may be 0)."


def demo_pair(group: tuple[int, int] | None = None) -> tuple[str, str]:
    """(sender, receiver) checkpoint paths of the zoo's first demo pair (ci tier if absent);
    `group` must fit the receiver."""
    from droidmesh.shared.zoo.manifest import find_tiers, resolve_model

    for tier, _dir, man in find_tiers():
        pair = man["pairs"][0]
        sender, receiver = (resolve_model(f"{tier}/{pair[role]}") for role in ("sender", "receiver"))
        if group is not None:
            check_group(group, checkpoint_layers(receiver.path))
        return str(sender.path), str(receiver.path)
    raise click.ClickException("no zoo tier built: run `droidmesh zoo build --tier demo` (or ci)")


def model_pair(spec: str | None, group: tuple[int, int] | None = None) -> tuple[str, str]:
    """(sender, receiver) checkpoint paths of `spec`, "SENDER:RECEIVER" as `zoo list` names
    models (e.g. real/base:real/docqa) or checkpoint paths; None: `demo_pair`. `group` must fit
    the receiver."""
    if spec is None:
        return demo_pair(group)
    from droidmesh.shared.errors import DroidMeshError
    from droidmesh.shared.zoo.manifest import resolve_model

    sender, sep, receiver = spec.partition(":")
    if not sep or not sender or not receiver:
        raise click.BadParameter(f"{spec!r}: expected SENDER:RECEIVER", param_hint="'--pair'")
    try:
        s_ref, r_ref = resolve_model(sender), resolve_model(receiver)
        if group is not None:
            check_group(group, checkpoint_layers(r_ref.path))
    except DroidMeshError as e:
        raise click.BadParameter(str(e), param_hint="'--pair'") from None
    return str(s_ref.path), str(r_ref.path)


def save(json_path: str | None, suite: str, payload: dict) -> None:
    report.write_json(json_path, {"suite": suite, "machine": report.machine(), **payload})


DEFAULT_GROUPS = {"base": (4, 6), "summ": (0, 6)}  # the demo pairs' profiled groups, when no profile is saved
DEFAULT_GROUP = (6, 12)  # any other pair's, when no profile is saved and no --group is given
