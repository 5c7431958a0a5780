"""The shm bulk channel: same-host pulls out of sealed shared memory, one kernel copy per byte.

Between two processes on one host the bytes need no network at all: the sender places each stored
context in one sealed memfd (`memfd.py`) and grants a pull by passing those descriptors over a
Unix socket (`shm_io.py`); the receiver reads them straight into its buffers (`preadv` the
first time, then out of a mapping it keeps for the connection).
  layout.py  how an item's rows lie in a memfd (both sides)
  kept.py    the receiver's kept mappings of placed memfds
  server.py  `ShmBulkServer` (sender): placing, grants
  client.py  `ShmBulkClient` (receiver): checks, then reads
`registry.py` imports the server or client module on demand; both classes are re-exported here.
"""

from droidmesh.shared.transport.shm.client import ShmBulkClient
from droidmesh.shared.transport.shm.layout import MAX_FDS
from droidmesh.shared.transport.shm.server import ShmBulkServer

__all__ = ["MAX_FDS", "ShmBulkClient", "ShmBulkServer"]
