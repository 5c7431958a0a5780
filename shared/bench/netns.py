"""Two network namespaces joined by a veth pair whose rate `tc` limits: a sender host and a
receiver host with a link of known bandwidth (root only; every address is one we create).

    ns dm-snd  (10.77.0.1/24) <== veth, tbf rate R on both ends ==> ns dm-rcv (10.77.0.2/24)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

SND, RCV = "dm-snd", "dm-rcv"
SND_IP, RCV_IP = "10.77.0.1", "10.77.0.2"


def _sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found"
    return None


def teardown() -> None:
    for ns in (SND, RCV):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def set_rate(rate_mbit: float | None) -> None:
    """Limit both directions of the link to `rate_mbit` (None: unlimited)."""
    for ns, dev in ((SND, "veth-snd"), (RCV, "veth-rcv")):
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
        if rate_mbit:
            burst = max(64_000, int(rate_mbit * 1e6 / 8 / 250))  # ~4 ms of traffic per token bucket
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms")


@contextlib.contextmanager
def link() -> Iterator[tuple[list[str], list[str]]]:
    """Create the two hosts; yield the command prefixes that run a process in each."""
    teardown()
    try:
        for ns in (SND, RCV):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _sh("ip", "link", "add", "veth-snd", "type", "veth", "peer", "name", "veth-rcv")
        _sh("ip", "link", "set", "veth-snd", "netns", SND)
        _sh("ip", "link", "set", "veth-rcv", "netns", RCV)
        _sh("ip", "netns", "exec", SND, "ip", "addr", "add", f"{SND_IP}/24", "dev", "veth-snd")
        _sh("ip", "netns", "exec", RCV, "ip", "addr", "add", f"{RCV_IP}/24", "dev", "veth-rcv")
        for ns, dev in ((SND, "veth-snd"), (RCV, "veth-rcv")):
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
        yield ["ip", "netns", "exec", SND], ["ip", "netns", "exec", RCV]
    finally:
        teardown()
