"""`bench transfer`'s tensor server as a child process (`tensor_proc.TensorServer`, a
`launch.Proc`): its address, its one-line refusal, or why it has none when it exits silently."""

from __future__ import annotations

import sys

from droidmesh.shared.tools.bench import tensor_proc, tensor_server
from droidmesh.shared.tools.bench.tensor_proc import TensorServer


def test_a_refusing_server_gives_its_one_line_and_no_address():
    server = TensorServer("no-such-channel", [4096])
    try:
        server.wait_ready(60)
        assert server.address is None and server.error is not None and "no-such-channel" in server.error
    finally:
        lines = server.stop()
    assert any(line.startswith(tensor_server.ERROR_PREFIX) for line in lines)


def test_a_server_that_exits_without_a_line_is_said_to_have_exited(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # exits at once, printing nothing
    server = TensorServer("shm", [4096])
    try:
        server.wait_ready(60)
        assert server.address is None and server.error == "tensor server exited (1): no output"
    finally:
        server.stop()


def test_a_server_that_listens_gives_its_address():
    server = TensorServer("shm", [4096])
    try:
        server.wait_ready(tensor_proc.SERVER_START_S)
        assert server.error is None and server.address
    finally:
        assert server.stop() is server.lines
