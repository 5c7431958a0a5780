"""This process's ucxx, initialised once with given UCX options, and the address shapes it reads.

Torch-free: a sender's sandbox processes (`shared/transport/sandbox/`) import it, and so does
`runtime.py`, which adds the options that depend on the machine (CUDA, network devices).
`ucxx(options)` blocks for UCX's initialisation the first time (well under a second); `UCX_*`
variables set by an operator still win over the options.
"""

from __future__ import annotations

from typing import Any

from droidmesh.shared.transport.ucp_address import LocalView

_ucxx: Any = None
_local: LocalView | None = None


def initialised() -> bool:
    return _ucxx is not None


def ucxx(options: dict[str, str]) -> Any:
    """The ucxx module, initialised with `options` on the first call (later calls' are ignored)."""
    global _ucxx
    if _ucxx is None:
        import ucxx as module

        module.init(options=options, env_takes_precedence=True)
        _ucxx = module
    return _ucxx


def local_view(options: dict[str, str]) -> LocalView:
    """Which transports this process's UCX runs and the address shapes they read (from our own
    worker address), the reference every peer's address is checked against; `BadMessageError`
    where our own address cannot be read (then no peer is wired up)."""
    global _local
    if _local is None:
        _local = LocalView.of(ucxx(options).get_worker_address().tobytes())
    return _local
