"""The UCX bulk channel (ucxx): one `BulkServer` / `BulkClient` pair over real endpoints.

The protocol and its checks are `shared/transport/bulk.py`'s; this package only moves bytes: the
request and response as UCX object messages, then every payload as one tagged message.
  runtime.py  ucxx initialised once with DroidMesh's options; network devices; CUDA asks
  ops.py      UCX operations that keep their buffers alive until UCX lets go; framing; abort
  wireup.py   the TCP hello that exchanges worker addresses (checked before UCX sees them)
  server.py   `UcxBulkServer` (sender)
  client.py   `UcxBulkClient` (receiver)
`registry.py` imports the server or client module on demand. What other code uses of the
channel's machinery is re-exported here.
"""

from droidmesh.shared.transport.ucx.ops import in_flight, recv_frame
from droidmesh.shared.transport.ucx.runtime import ask_device, honour_device, ucx_options, ucxx
from droidmesh.shared.transport.ucx.wireup import connect

__all__ = ["ask_device", "connect", "honour_device", "in_flight", "recv_frame", "ucx_options", "ucxx"]
