"""The engine client's view of an engine's output: a reply over HTTP comes back with the log
lines its request wrote before it already read (vLLM's reply travels on a socket, its lines on
a pipe, and nothing orders the two), and the client's own marks never show up as lines."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from droidmesh.shared.engines.vllm.client import MARK, EngineProcess, ServedEngine
from droidmesh.shared.service.launch import free_port

# Prints the connector's line for a request, then answers it: what vLLM's processes do.
SERVER = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        rid = self.headers["X-Request-Id"]
        print("(APIServer pid=1) INFO scheduling", flush=True)
        print('(EngineCore pid=1) {"event": "loaded", "request_id": "cmpl-%s-0-ab"}' % rid, flush=True)
        body = json.dumps({"choices": [{"token_ids": [7, 8]}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class SlowReader(ServedEngine):
    """A client whose reader falls behind before the connector's line (a busy machine)."""

    def __init__(self, workdir: Path, port: int):
        self.url, self.base_name = f"http://127.0.0.1:{port}", "base"
        EngineProcess.__init__(self, [sys.executable, "-c", SERVER, str(port)], workdir, None, stdin=False)

    def on_line(self, line: str) -> None:
        if "INFO scheduling" in line:
            time.sleep(1.0)


def test_a_reply_comes_back_with_the_lines_its_request_wrote_already_read(tmp_path):
    engine = SlowReader(tmp_path, free_port())
    try:
        engine.ready(30.0)
        got = engine.ask("r1", [1, 2, 3], max_tokens=2)
        assert got["tokens"] == [7, 8]
        (loaded,) = engine.events("loaded", got["request_id"])
        assert loaded["request_id"] == "cmpl-r1-0-ab"
    finally:
        engine.stop()


def test_marks_are_not_lines_and_draining_an_exited_engine_returns(tmp_path):
    engine = EngineProcess([sys.executable, "-c", "print('one', flush=True)"], tmp_path, None, stdin=False)
    engine.drained()
    engine.proc.wait(120)  # a deadline, not a timing: a starved machine once took > 30 s
    engine.drained()  # our end is closed once it exits: this waits for the end of its output instead
    assert engine.lines == ["one"] and not any(MARK in line for line in engine.lines)
    engine.stop()
