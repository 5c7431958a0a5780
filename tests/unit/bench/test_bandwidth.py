"""`bench bandwidth`'s pieces: the launched processes' environment and the per-row UCX transport
(parsed from UCX_PROTO_INFO tables; no namespaces, no timing)."""

from __future__ import annotations

from droidmesh.shared.tools.bench import bandwidth

SEND = """\
[1.0] [vm:1:0]   | ucp_context_0 inter-node cfg#2 | tagged message by ucp_tag_send* from host memory       |
[1.0] [vm:1:0]   |                              0..8 | eager short                                     | tcp/veth-snd |
[1.0] [vm:1:0]   |                        65K..inf | rendezvous zero-copy fenced write to remote     | tcp/veth-snd |
""".splitlines()
GET = """\
[1.0] [vm:1:0]   | ucp_context_0 inter-node cfg#1 | remote memory read by ucp_get* from host memory |
[1.0] [vm:1:0]   |                         0..inf | zero-copy                                       | tcp/veth-rcv |
""".splitlines()


def test_bandwidth_env_sets_the_channel_on_both_ends_and_keeps_shared_memory_off(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    env = bandwidth.bandwidth_env("nixl", bandwidth.CROSS_HOST_UCX_TLS)
    assert env["DM_SENDER_TRANSPORT"] == env["DM_RECEIVER_TRANSPORT"] == "nixl"
    assert env["UCX_TLS"] == "tcp,self" and env["UCX_PROTO_INFO"] == "y"
    assert "UCX_TLS" not in bandwidth.bandwidth_env("ucx", None)
    monkeypatch.setenv("UCX_TLS", "rc,self")
    assert bandwidth.bandwidth_env("ucx", "tcp,self")["UCX_TLS"] == "rc,self"  # the operator's wins


def test_row_transport_ucx_from_the_sender_nixl_from_the_probe():
    tcp = "tcp/veth-snd: rendezvous zero-copy fenced write to remote"
    assert bandwidth._row_ucx_transport("ucx", SEND, [], None) == tcp
    assert bandwidth._row_ucx_transport("ucx", [], [], tcp) == tcp  # no new table: the endpoint's earlier one
    assert bandwidth._row_ucx_transport("nixl", SEND, GET, None) == "tcp/veth-rcv: zero-copy"
    assert bandwidth._row_ucx_transport("nixl", [], SEND, None) is None
