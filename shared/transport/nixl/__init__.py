"""The NIXL bulk channel: one-sided reads of the sender's registered memory (tried on one host).

The protocol and its checks are `shared/transport/bulk.py`'s and `answer.py`'s; this package moves the control
messages over a small TCP stream and the bytes by NIXL READs, which the receiver's agent performs
straight into its own buffers.
  agent.py     a NIXL agent with the UCX backend, confined to one thread
  frames.py    the control stream's bounded, deadlined frames
  metadata.py  a sender's NIXL metadata, checked before the receiver's agent loads it
  server.py    `NixlBulkServer` (sender): grants
  client.py    `NixlBulkClient` (receiver): reads
`registry.py` imports the server or client module on demand.
"""
