"""Sandbox processes: the memory a peer can reach over UCX or NIXL holds only what it was granted.

NIXL's and UCX's one-sided operations read memory by address, and on the transports a host uses
without RDMA hardware nothing bounds that address to a registration: a CMA read is the reader's
own `process_vm_readv`, and UCX's TCP GET copies from whatever address the request names (a bad
one kills the process). A library abort on a peer's behaviour (an endpoint from a foreign UCX)
kills the process too. So the sender runs each receiver connection of the ucx and nixl channels
in a process of its own, which holds the library and, while a pull lasts, the memfds of the
contexts that pull was granted, and nothing else: no other tenant's KV, no credential, no other
connection. What a peer makes the library do reaches that process only; if it dies, that
connection's pull fails (the receiver falls back) and the sender goes on.
  host.py     `SandboxPool` / `Sandbox`: starting, talking to, ending them (the sender's side)
  regions.py  a pull's payloads as memfd regions to pass
  child.py    the process itself (torch-free): a NIXL agent or a UCX worker per connection
"""
