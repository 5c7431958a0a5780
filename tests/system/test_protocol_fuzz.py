"""Valid bulk-channel messages in wrong orders against a real sender process, per channel
(`tests/system/protocol_fuzz.py`): no byte outside a live grant comes back and the sender never
dies. CI runs SEQUENCES per channel; the closing measurement ran 10,000 (`python -m
tests.system.protocol_fuzz CHANNEL --sequences 10000 --seed 10`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.system, pytest.mark.security, pytest.mark.fuzz]

SEQUENCES = 60


@pytest.mark.parametrize("channel", ["ucx", "nixl", "shm"])
def test_valid_messages_in_wrong_orders_read_nothing_outside_a_grant_and_kill_no_sender(channel):
    if channel == "nixl":
        pytest.importorskip("nixl_cu12")
    out = subprocess.run([sys.executable, "-m", "tests.system.protocol_fuzz", channel, "--sequences", str(SEQUENCES),
                          "--seed", "3"], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = [l for l in out.stdout.splitlines() if l.startswith("FUZZ=")]
    assert line, f"the fuzzer failed (status {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    counts = json.loads(line[0][len("FUZZ="):])
    if "unavailable" in counts:
        pytest.skip(f"{channel} unavailable here: {counts['unavailable']}")
    assert counts["sender_alive"] and counts.get("violations", 0) == 0, counts
    assert counts["sequences"] == SEQUENCES and counts["granted"] > 0 and counts["refused"] > 0, counts
    if channel == "nixl":
        assert counts.get("reads_done", 0) > 0, counts  # the forged and edge READs ran
    assert out.returncode == 0, out.stdout[-2000:]
