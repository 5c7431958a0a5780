"""Two network namespaces joined by a veth pair whose rate `tc` limits: a sender host and a
receiver host with a link of known bandwidth (root only; every address is one we create).

    ns dm-snd-<pid>  (10.77.0.1/24) <== veth, tbf rate R on both ends ==> ns dm-rcv-<pid> (10.77.0.2/24)

Named namespaces outlive every process in them, so none may outlive its owner (<pid>, the process
in `link`): `link` starts a reaper first, a shell waiting for the end of a pipe only the owner
holds, which deletes the two when the owner is gone however it ended (SIGKILL included), and
deletes the namespaces of owners no longer alive (whose reaper was killed with them) before making
its own. Processes started in them through `shared.service.launch` die with the owner too. One
link per process at a time.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator

SND_IP, RCV_IP = "10.77.0.1", "10.77.0.2"
_OWNED = re.compile(r"^dm-(?:snd|rcv)-(\d+)$")
_UNOWNED = ("dm-snd", "dm-rcv")  # names from before owners were named: no owner can still use them
REAP_TIMEOUT_S = 30.0


def names(pid: int | None = None) -> tuple[str, str]:
    """(sender's, receiver's) namespace of the link process `pid` (default: this one) owns."""
    pid = os.getpid() if pid is None else pid
    return f"dm-snd-{pid}", f"dm-rcv-{pid}"


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
    for ns in names():
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the link namespaces whose owner is gone; returns their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    stale = []
    for line in listed.splitlines():
        name = (line.split() or [""])[0]  # "NAME" or "NAME (id: N)"
        owner = _OWNED.match(name)
        if name in _UNOWNED or (owner is not None and not _alive(int(owner.group(1)))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            stale.append(name)
    return stale


def _reaper(namespaces: tuple[str, ...]) -> subprocess.Popen:
    """A shell that deletes `namespaces` once its stdin ends: when we close it, or when the kernel
    closes it because this process is gone (nothing else holds the pipe: it is not inheritable).
    Its own session and no parent-death signal: it must outlive us."""
    script = 'cat >/dev/null; for ns; do ip netns del "$ns" 2>/dev/null; done'
    return subprocess.Popen(["sh", "-c", script, "dm-netns-reaper", *namespaces], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def set_rate(rate_mbit: float | None) -> None:
    """Limit both directions of the link to `rate_mbit` (None: unlimited)."""
    for ns, dev in zip(names(), ("veth-snd", "veth-rcv"), strict=True):
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
        if rate_mbit:
            burst = max(64_000, int(rate_mbit * 1e6 / 8 / 250))  # ~4 ms of traffic per token bucket
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms")


@contextlib.contextmanager
def link() -> Iterator[tuple[list[str], list[str]]]:
    """Create the two hosts; yield the command prefixes that run a process in each."""
    snd, rcv = names()
    remove_stale()
    teardown()
    reaper = _reaper((snd, rcv))  # before the first namespace exists
    try:
        for ns in (snd, rcv):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        # both ends made inside their namespaces: no interface name in the host's, where links may race
        _sh("ip", "link", "add", "veth-snd", "netns", snd, "type", "veth", "peer", "name", "veth-rcv", "netns", rcv)
        _sh("ip", "netns", "exec", snd, "ip", "addr", "add", f"{SND_IP}/24", "dev", "veth-snd")
        _sh("ip", "netns", "exec", rcv, "ip", "addr", "add", f"{RCV_IP}/24", "dev", "veth-rcv")
        for ns, dev in ((snd, "veth-snd"), (rcv, "veth-rcv")):
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
        yield ["ip", "netns", "exec", snd], ["ip", "netns", "exec", rcv]
    finally:
        teardown()
        assert reaper.stdin is not None
        reaper.stdin.close()  # it deletes them again (nothing left) and exits
        try:
            reaper.wait(REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            reaper.kill()
            reaper.wait()
