"""Chaos: a mesh of separate processes (nats-server, broker, two senders, two receivers) under a
steady request stream while a scripted fault schedule runs: a sender frozen past the reuse timeout
and resumed, a sender killed and restarted, the broker restarted, a sender frozen until the broker
declares it dead and resumed. Every request must be answered, no process may crash, and every
process's peak RSS stays under a generous bound (a table is printed and written as JSON).

The schedule is driven by events only (requests answered, replies' paths, the services' own log
lines); the only time limits are guards that turn a hang into a failure with a diagnosis."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.service.launch import Proc, start_service
from tests.system.conftest import words

pytestmark = [pytest.mark.system, pytest.mark.fault]

# PYTHONFAULTHANDLER: a segfault in a service prints the Python stack of every thread to its log.
ENV = {"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
CONTEXTS = {"sender_a": words(1500, offset=0), "sender_b": words(1500, offset=3)}  # one context per sender
# The receivers hold nothing of their own: the chaos is the senders', whose caches every request must use.
RECEIVER_ARGS = {"model_id": "receiver", "default_group": [2, 4], "reuse_timeout_s": 2.0, "hold": False}
SENDER_ARGS = {"e_layers": [2], "heartbeat_s": 1.5}  # the broker declares a sender dead after 3 missed beats (4.5 s)
WORKERS = 3  # requests in flight at once
STEP = 12  # answers awaited after each fault before the next one
MAX_NEW = 2
REQUEST_S, ATTEMPT_S = 45.0, 5.0  # each request's own deadline; a silent attempt is retried (same id)
GUARD_S = 90.0  # an awaited event that never comes fails the test (a hang guard, not a timing assertion)
PEAK_RSS_BOUND = 2 << 30  # guards against unbounded growth; not a tuning target
CRASH_MARKS = ("Segmentation fault", "Fatal Python error", "Traceback (most recent call last)", '"request_crashed"',
               '"event_crashed"', '"task_crashed"', '"background_task_failed"', "panic:")


@dataclass
class Outcome:
    phase: str
    context: str
    path: str | None = None  # None: not answered
    sender_id: str | None = None
    served_by: str | None = None
    reason: str | None = None
    error: str | None = None
    tokens: int = 0


@dataclass
class Memory:
    """VmRSS sampled on events, VmHWM (the kernel's peak RSS) read last while each process lived."""

    rss_max: dict[str, int] = field(default_factory=dict)
    rss_first: dict[str, int] = field(default_factory=dict)
    hwm: dict[str, int] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))

    def sample(self, procs: dict[str, Proc]) -> None:
        for name, p in procs.items():
            if p.popen.poll() is not None:
                continue
            try:
                status = Path(f"/proc/{p.popen.pid}/status").read_text()
            except OSError:  # exited between the poll and the read
                continue
            vals = {k: int(v.split()[0]) * 1024 for k, v in (l.split(":", 1) for l in status.splitlines() if ":" in l)
                    if k in ("VmRSS", "VmHWM")}
            if "VmRSS" in vals:
                self.rss_first.setdefault(name, vals["VmRSS"])
                self.rss_max[name] = max(self.rss_max.get(name, 0), vals["VmRSS"])
                self.samples[name] += 1
            if "VmHWM" in vals:
                self.hwm[name] = vals["VmHWM"]

    def peak(self, name: str) -> int:
        return max(self.hwm.get(name, 0), self.rss_max.get(name, 0))

    def table(self) -> list[dict]:
        return [{"process": n, "peak_rss_mib": round(self.peak(n) / 2**20, 1),
                 "first_rss_mib": round(self.rss_first.get(n, 0) / 2**20, 1),
                 "max_sampled_rss_mib": round(self.rss_max.get(n, 0) / 2**20, 1), "samples": self.samples[n]}
                for n in sorted(self.hwm)]


def _start_all(url: str, tiny_pair, log_dir: Path) -> dict[str, Proc]:
    """Broker, both senders and both receivers, started in parallel (each ready per its log)."""
    sender_dir, receiver_dir = tiny_pair
    specs = {
        "broker": ("cache_broker", {}),
        "sender_a": ("sender", {"model_path": sender_dir, "model_id": "sender_a", **SENDER_ARGS}),
        "sender_b": ("sender", {"model_path": sender_dir, "model_id": "sender_b", **SENDER_ARGS}),
        "receiver0": ("receiver", {"model_path": receiver_dir, **RECEIVER_ARGS}),
        "receiver1": ("receiver", {"model_path": receiver_dir, **RECEIVER_ARGS}),
    }
    with ThreadPoolExecutor(len(specs)) as pool:
        futs = {name: pool.submit(start_service, svc, args, url, name=name, env=ENV, log_dir=log_dir)
                for name, (svc, args) in specs.items()}
        return {name: f.result() for name, f in futs.items()}


def _sender_id(p: Proc) -> str:
    return p.events("sender_started")[0]["sender_id"]


def _broker_id(p: Proc) -> str:
    return p.events("broker_started")[0]["broker_id"]


UCX_LISTENER_ERROR = "Unexpected error in listener handler coroutine"


def _crash_lines(p: Proc) -> tuple[list[str], int]:
    """(lines that mark a crash, how many ucx listener handshake errors were logged). The ucxx
    library logs a traceback when a peer abandons a connection handshake (a receiver whose pull timed
    out while the sender was frozen); it is caught inside the library's listener coroutine, so
    tracebacks in that block are counted and reported, not taken as a crash."""
    marks, listener_errors, in_listener_block = [], 0, False
    for line in list(p.lines):
        if UCX_LISTENER_ERROR in line:
            listener_errors, in_listener_block = listener_errors + 1, True
            continue
        if line.startswith(("{", "[")):  # the next JSON log line or UCX log line ends the block
            in_listener_block = False
        if any(m in line for m in CRASH_MARKS) and not (in_listener_block and "Traceback" in line):
            marks.append(line[:400])
    return marks, listener_errors


LIVENESS = ("sender_live", "sender_expired", "sender_returned", "reannounced", "heartbeat_late", "heartbeat_failed",
            "nats_disconnected", "nats_reconnected", "nats_error", "task_crashed", "task_restarted")


def _liveness(procs: dict[str, Proc]) -> str:
    """Each process's liveness events (heartbeats, expiries, re-announcements, NATS reconnects),
    the last few of each kind, one line per process: what a hang guard's diagnosis needs."""
    out = []
    for n, p in procs.items():
        seen = {k: [str(e.get("timestamp", ""))[11:22] + ":" + str(e.get("sender_id") or e.get("late_s") or
                                                                 e.get("broker_id") or e.get("error") or "")[:40]
                    for e in p.events(k)][-3:] for k in LIVENESS}
        out.append(f"liveness {n}: {json.dumps({k: v for k, v in seen.items() if v})}")
    return "\n".join(out)


def test_chaos_mesh_answers_everything_and_stays_bounded(nats, services, tiny_pair, tmp_path):
    """Freeze/resume, kill/restart senders and restart the broker under load: all answered, no crash, peak RSS bounded."""
    nats_proc, url = nats
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    live = _start_all(url, tiny_pair, log_dir)  # by role: the processes that must be alive at the end
    services.extend(live.values())  # stopped at teardown whatever happens
    unique = {"broker": "broker#1", "sender_b": "sender_b#1"}  # the ones replaced during the run
    procs = {"nats": nats_proc, **{unique.get(n, n): p for n, p in live.items()}}  # every process ever started
    mem = Memory()
    outcomes: list[Outcome] = []
    faults: list[str] = []
    phase = ["warmup"]
    frozen: list[Proc] = []

    def answered() -> list[Outcome]:
        return [o for o in outcomes if o.path is not None]

    started: dict[str, float] = {"warmup": time.monotonic()}

    def enter(name: str) -> None:
        phase[0], started[name] = name, time.monotonic()

    def state() -> str:
        paths = collections.Counter((o.phase, o.path or "UNANSWERED", (o.reason or "")[:40]) for o in outcomes)
        tails = "\n".join(f"--- {n} (rc={p.popen.poll()}):\n{p.tail(8)}" for n, p in procs.items())
        marks = {n: lines[:20] for n, p in procs.items() if (lines := _crash_lines(p)[0])}
        # the summary last: a CI log that keeps only the end of the output still shows it
        return (f"{tails}\ncrash marks: {json.dumps(marks, indent=1)[:6000]}\n{_liveness(procs)}\nfaults: {faults}\n"
                f"phase={phase[0]} outcomes={dict(paths)}")

    async def run() -> None:
        client = await MeshClient.connect(url)
        stop = asyncio.Event()

        async def worker(k: int) -> None:
            name = sorted(CONTEXTS)[k % len(CONTEXTS)]
            i = 0
            while not stop.is_set():
                o = Outcome(phase[0], name)
                try:  # the id names the context: the receivers' reuse_fallback lines tell which sender failed
                    r = await client.ask("receiver", CONTEXTS[name], f" q{k}-{i}", max_new_tokens=MAX_NEW,
                                         timeout=REQUEST_S, attempt_s=ATTEMPT_S, request_id=f"{name}-{k}-{i}")
                    o.path, o.sender_id, o.served_by, o.reason = r.path, r.sender_id, r.served_by, r.fallback_reason
                    o.tokens = len(r.token_ids)
                except Exception as e:  # noqa: BLE001 - every unanswered request is counted, not raised
                    o.error = repr(e)[:300]
                outcomes.append(o)
                i += 1
                if len(outcomes) % 3 == 0:
                    mem.sample(procs)

        async def until(pred: Callable[[], bool], what: str) -> None:
            deadline = time.monotonic() + GUARD_S
            while not pred():
                dead = [n for n, p in live.items() if p.popen.poll() is not None and p not in frozen]
                if dead:
                    raise AssertionError(f"{state()}\n{dead} died while waiting for {what}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{state()}\nno {what} within {GUARD_S}s (hang guard)")
                await asyncio.wait(tasks, timeout=0.05)  # a poll tick; progress comes from the workers
                for t in tasks:
                    if t.done():
                        t.result()

        async def more(n: int) -> None:
            target = len(answered()) + n
            await until(lambda: len(answered()) >= target, f"{n} more answers")

        def reused_from(sender: str, since: int) -> Callable[[], bool]:
            return lambda: any(o.path == "partial" and o.sender_id == sender for o in outcomes[since:])

        def reuse_fallbacks(sender: str) -> int:  # logged by the receivers when a pull fails, before the fallback
            return sum(e["request_id"].startswith(f"{sender}-") for n, p in live.items() if n.startswith("receiver")
                       for e in p.events("reuse_fallback"))

        def expired(broker: Proc, sender: str) -> Callable[[], bool]:
            return lambda: any(e.get("sender_id") == sender for e in broker.events("sender_expired"))

        tasks: list[asyncio.Task] = []
        try:
            for name, ctx in CONTEXTS.items():
                await client.prefill(name, ctx)
            tasks.extend(asyncio.create_task(worker(k)) for k in range(WORKERS))
            sid = {n: _sender_id(live[n]) for n in CONTEXTS}
            await until(lambda: reused_from(sid["sender_a"], 0)() and reused_from(sid["sender_b"], 0)(),
                        "reuse from both senders")
            await more(STEP)

            # 1. Freeze sender_a under load until pulls from it time out (the reuse timeout), then resume.
            enter("freeze_a")
            base = reuse_fallbacks("sender_a")
            frozen.append(live["sender_a"])
            live["sender_a"].popen.send_signal(signal.SIGSTOP)
            faults.append("SIGSTOP sender_a")
            # Frozen until a receiver gave up a pull from it (past the reuse timeout), then resumed at
            # once: usually before the broker declares it dead, so late sends meet abandoned pulls.
            await until(lambda: reuse_fallbacks("sender_a") > base, "a receiver giving up a pull from the frozen sender_a")
            live["sender_a"].popen.send_signal(signal.SIGCONT)
            frozen.remove(live["sender_a"])
            faults.append(f"SIGCONT sender_a after {reuse_fallbacks('sender_a') - base} abandoned pulls "
                          f"(expired by the broker: {expired(live['broker'], sid['sender_a'])()})")
            enter("resumed_a")
            await more(STEP)
            await client.prefill("sender_a", CONTEXTS["sender_a"], timeout=REQUEST_S)  # the resumed sender serves

            # 2. Kill sender_b (SIGKILL: no goodbye), wait until the broker drops it, then restart it.
            enter("killed_b")
            mem.sample(procs)
            old_b = live.pop("sender_b")
            old_b.kill()
            faults.append("SIGKILL sender_b")
            assert old_b.popen.returncode == -signal.SIGKILL, old_b.popen.returncode
            await until(expired(live["broker"], sid["sender_b"]), "the broker expiring the killed sender_b")
            await more(STEP)
            enter("restart_b")
            live["sender_b"] = procs["sender_b#2"] = await asyncio.to_thread(
                start_service, "sender", {"model_path": tiny_pair[0], "model_id": "sender_b", **SENDER_ARGS}, url,
                name="sender_b#2", env=ENV, log_dir=log_dir)
            services.append(live["sender_b"])
            faults.append("restarted sender_b")
            sid["sender_b"] = _sender_id(live["sender_b"])
            mark = len(outcomes)
            await client.prefill("sender_b", CONTEXTS["sender_b"], timeout=REQUEST_S)
            await until(reused_from(sid["sender_b"], mark), "reuse from the restarted sender_b")
            await more(STEP)

            # 3. Restart the broker (SIGTERM, then a fresh copy): senders re-announce, reuse resumes.
            enter("broker_restart")
            mem.sample(procs)
            old_broker = live.pop("broker")
            rc = await asyncio.to_thread(old_broker.stop, 30)
            faults.append(f"SIGTERM broker (exit {rc})")
            assert rc == 0, f"broker exited {rc} on SIGTERM:\n{old_broker.tail(20)}"
            live["broker"] = procs["broker#2"] = await asyncio.to_thread(
                start_service, "cache_broker", {}, url, name="broker#2", env=ENV, log_dir=log_dir)
            services.append(live["broker"])
            faults.append("restarted broker")
            new_id = _broker_id(live["broker"])
            mark = len(outcomes)
            for n in CONTEXTS:
                await until(lambda n=n: any(e.get("broker_id") == new_id for e in live[n].events("reannounced")),
                            f"{n} re-announcing to the new broker")
                await until(lambda n=n: any(e.get("sender_id") == sid[n] for e in live["broker"].events("sender_live")),
                            f"the new broker hearing {n} live")
            await until(lambda: reused_from(sid["sender_a"], mark)() and reused_from(sid["sender_b"], mark)(),
                        "reuse from both senders after the broker restart")
            await more(STEP)

            # 4. Freeze sender_a again, this time until the broker declares it dead, then resume.
            enter("freeze_a2")
            base = reuse_fallbacks("sender_a")
            frozen.append(live["sender_a"])
            live["sender_a"].popen.send_signal(signal.SIGSTOP)
            faults.append("SIGSTOP sender_a")
            await until(expired(live["broker"], sid["sender_a"]), "the broker expiring the frozen sender_a")
            live["sender_a"].popen.send_signal(signal.SIGCONT)
            frozen.remove(live["sender_a"])
            faults.append(f"SIGCONT sender_a after the broker expired it ({reuse_fallbacks('sender_a') - base} abandoned pulls)")
            enter("resumed_a2")
            await more(STEP)
            await client.prefill("sender_a", CONTEXTS["sender_a"], timeout=REQUEST_S)
            await more(STEP)
        finally:
            for p in frozen:
                p.popen.send_signal(signal.SIGCONT)
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            mem.sample(procs)
            await client.close()

    try:
        asyncio.run(run())
    finally:
        started["end"] = time.monotonic()
        retries = sum(len(p.events("duplicate_request")) for n, p in procs.items() if n.startswith("receiver"))
        report(mem, outcomes, faults, tmp_path, started, retries)

    unanswered = [o for o in outcomes if o.path is None]
    assert not unanswered, f"{len(unanswered)} of {len(outcomes)} requests unanswered: {unanswered[:10]}\n{state()}"
    dead = {n: p.popen.poll() for n, p in live.items() if p.popen.poll() is not None}
    assert nats_proc.popen.poll() is None, nats_proc.tail(20)
    assert not dead, f"service processes died (exit status; negative = signal): {dead}\n{state()}"
    mem.sample(procs)  # VmHWM once more while everything still lives
    over = {n: mem.peak(n) for n in procs if mem.peak(n) >= PEAK_RSS_BOUND}
    assert not over, f"peak RSS over {PEAK_RSS_BOUND >> 20} MiB: {over}"
    assert set(mem.hwm) == set(procs), (set(procs) - set(mem.hwm))  # every process was measured
    # A graceful stop: receivers first, then senders, then the broker (the processes of one step stop together).
    for step in ([n for n in live if n.startswith("receiver")], ["sender_a", "sender_b"], ["broker"]):
        for name in step:
            live[name].signal_stop()
        for name in step:
            assert (rc := live[name].stop(grace=30)) == 0, f"{name} exited {rc} on SIGTERM:\n{live[name].tail(20)}"
    scanned = {n: _crash_lines(p) for n, p in procs.items()}
    print("  ucx listener handshake errors logged: " + str({n: k for n, (_, k) in scanned.items() if k}))
    crashes = {n: lines for n, (lines, _) in scanned.items() if lines}
    assert not crashes, f"crash marks in logs: {json.dumps(crashes, indent=1)[:4000]}"
    assert all(o.tokens >= 1 for o in outcomes), [o for o in outcomes if o.tokens < 1][:5]
    paths = collections.Counter(o.path for o in outcomes)
    assert paths["partial"] > 0 and paths["fallback"] > 0, paths  # reuse ran, and the faults really hit it


def report(mem: Memory, outcomes: list[Outcome], faults: list[str], tmp_path: Path, started: dict[str, float],
           retries: int) -> None:
    """Print (and write as JSON under tmp_path) the peak RSS table, the paths by phase and the faults."""
    by_phase: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for o in outcomes:
        by_phase[o.phase][o.path or "UNANSWERED"] += 1
    out = {"peak_rss": mem.table(), "faults": faults, "requests": len(outcomes),
           "answered": sum(o.path is not None for o in outcomes), "retries_seen_by_receivers": retries,
           "paths": dict(collections.Counter(o.path or "UNANSWERED" for o in outcomes)),
           "paths_by_phase": {k: dict(v) for k, v in by_phase.items()},
           "phase_s": {k: round(t1 - t0, 1) for (k, t0), (_, t1) in itertools.pairwise(started.items())},
           "fallback_reasons": dict(collections.Counter((o.reason or "")[:60] for o in outcomes if o.path == "fallback")),
           "served_by": dict(collections.Counter(o.served_by for o in outcomes if o.served_by)),
           "errors": [o.error for o in outcomes if o.error][:20]}
    (tmp_path / "chaos_report.json").write_text(json.dumps(out, indent=1))
    print(f"\nchaos: {out['answered']}/{out['requests']} answered ({retries} client retries reached a receiver); "
          f"paths {out['paths']}")
    for k, v in out["paths_by_phase"].items():
        print(f"  {k:<15} {out['phase_s'].get(k, '?'):>5}s {dict(v)}")
    print("  faults: " + "; ".join(faults))
    print(f"  {'process':<12} {'peak RSS MiB':>12} {'first RSS MiB':>13} {'samples':>8}")
    for row in out["peak_rss"]:
        print(f"  {row['process']:<12} {row['peak_rss_mib']:>12} {row['first_rss_mib']:>13} {row['samples']:>8}")
    print(f"  report: {tmp_path / 'chaos_report.json'}")
