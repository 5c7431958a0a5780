"""The UCX bulk channel (ucxx): one `BulkServer` / `BulkClient` pair over real endpoints.

The protocol and its checks are `shared/transport/bulk.py`'s and `answer.py`'s; this package only moves bytes: the
request and response as UCX object messages, then every payload as one tagged message.
  worker.py   this process's ucxx, initialised once (torch-free: sandbox processes use it)
  runtime.py  DroidMesh's UCX options; network devices; CUDA asks
  ops.py      UCX operations that keep their buffers alive until UCX lets go; framing; abort
  wireup.py   the TCP hello (with the first request) and the sender's welcome
  server.py   `UcxBulkServer` (sender): each connection served by a sandbox process
  client.py   `UcxBulkClient` (receiver)
`registry.py` imports the server or client module on demand. What other code uses of the
channel's machinery is re-exported here.
"""

from importlib import import_module
from typing import Any

# Re-exported lazily: a sandbox process imports `worker` and `ops` without torch (`runtime` needs it).
_EXPORTS = {"in_flight": "ops", "recv_frame": "ops", "ask_device": "runtime", "honour_device": "runtime",
            "ucx_options": "runtime", "ucxx": "runtime"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)
