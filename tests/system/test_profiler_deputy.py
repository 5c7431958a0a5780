"""The profiler is no confused deputy: on a real nats-server under per-role users (a conf
`shared.mesh.nats_auth` renders) with a real profiler process, a receiver's login can have no
config published at all (a re-profile with its rows is refused and recorded for operators, one
naming a version, relay buckets or files is refused as malformed), while an operator's re-profile
is published; no plan failing the test split is published, whoever asks; and an operator's data
files are read only as regular files under the data root, every other name refused with the one
message a missing file gets."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time

import msgspec
import nats
import pytest

from droidmesh.services.profiler.datafiles import NOT_ALLOWED
from droidmesh.shared.errors import BadMessageError
from droidmesh.shared.mesh.config_board import NatsConfigBoard
from droidmesh.shared.mesh.nats_auth import Roster, password_env, receiver_user, render
from droidmesh.shared.model.names import weights_sha256
from droidmesh.shared.service.launch import start_nats, start_service
from droidmesh.shared.tasks.jsonl import write_jsonl
from droidmesh.shared.tasks.suite import make_rows
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.zoo.tiers import get_recipe

pytestmark = [pytest.mark.system, pytest.mark.security]

ROSTER = Roster(senders=(), receivers=("qa",))
RECEIVER = receiver_user("qa")
TASK = "multihop_qa"
VETO = [schemas.RelayBucket(0.0, 0.5, False)]  # the audit's verdict on the pair's config in use
DEADLINE_S = 300.0  # a profile of the ci tier's models on two rows, waiting for one other at most


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_pair):
    """nats-server with ROSTER's users; a data root with two JSONL files (and traps beside and in
    it); a profiler mapping ids summ and qa, whose board already holds the pair's config in use
    (bound to the weights, with relay buckets), seen by the profiler."""
    tmp = tmp_path_factory.mktemp("deputy")
    passwords = {u: secrets.token_hex(12) for u in ROSTER.users}
    conf = tmp / "nats-auth.conf"
    conf.write_text(render(ROSTER))
    root = tmp / "data"
    root.mkdir()
    suite = get_recipe("ci").suite
    write_jsonl(root / "train.jsonl", make_rows(TASK, "train", 2, suite))
    write_jsonl(root / "test.jsonl", make_rows(TASK, "test", 2, suite))
    write_jsonl(tmp / "outside.jsonl", make_rows(TASK, "test", 2, suite))
    os.symlink(tmp / "outside.jsonl", root / "escape.jsonl")
    os.symlink("/dev/zero", root / "zero.jsonl")
    os.mkfifo(root / "fifo.jsonl")
    proc, url = start_nats(store_dir=str(tmp / "js"), conf=conf, env={password_env(u): p for u, p in passwords.items()})
    try:
        # New settings go by environment variable, so a profiler without them still starts.
        env = {"OMP_NUM_THREADS": "1", "DM_NATS_USER": "profiler", "DM_NATS_PASSWORD": passwords["profiler"],
               "DM_PROFILER_DATA_ROOT": str(root), "DM_PROFILER_MODELS": f"summ={tiny_pair[0]},qa={tiny_pair[1]}"}
        profiler = start_service("profiler", {}, url, env=env)
        try:
            in_use = _config_in_use(tiny_pair)
            asyncio.run(_put(url, passwords, in_use))
            profiler.wait_for(lambda line: '"config_seen"' in line and f"v{in_use.profile_version}" in line, 60,
                              "the config in use seen")
            yield url, passwords, root, tmp, profiler, in_use
        finally:
            profiler.stop()
    finally:
        proc.stop()


def _config_in_use(tiny_pair) -> schemas.RecomputeConfig:
    point = schemas.FrontierPoint(schemas.PlanSpec(groups=[(2, 4)]), recomputed_layers=2, quality=1.0)
    return schemas.RecomputeConfig(
        sender_model="summ", receiver_model="qa", sender_sha256=weights_sha256(tiny_pair[0]),
        receiver_sha256=weights_sha256(tiny_pair[1]), profile_version=int(time.time()) - 3600, task=TASK,
        tolerance=0.05, chosen=point, frontier=[point], full_prefill_quality=1.0, full_reuse_quality=0.5,
        total_layers=6, created_at=time.time(), relay=VETO)


async def _connect(url: str, user: str, passwords: dict[str, str], errors: list[str]):
    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    return await nats.connect(url, user=user, password=passwords[user], error_cb=on_error, max_reconnect_attempts=0,
                              inbox_prefix=subjects.inbox_prefix(user))


async def _put(url: str, passwords: dict[str, str], cfg: schemas.RecomputeConfig) -> None:
    admin = await _connect(url, "admin", passwords, [])
    try:
        await NatsConfigBoard(admin).put(cfg)
    finally:
        await admin.close()


async def _ask(nc, subject: str, req: schemas.ProfileRequest, timeout: float = DEADLINE_S
               ) -> schemas.ProfileReply | schemas.ErrorReply:
    data = (await nc.request(subject, schemas.encode(req), timeout=timeout)).data
    try:
        return schemas.decode(data, schemas.ProfileReply)
    except BadMessageError:
        return schemas.decode(data, schemas.ErrorReply)


def _reprofile(in_use: schemas.RecomputeConfig, request_id: str, **changes) -> schemas.ProfileRequest:
    """What a receiver of qa asks after drift: its recent rows, bound to the weights in use."""
    rows = [schemas.ProfileRow(context=r["context"], input=r["input"], answers=r["answers"])
            for r in make_rows(TASK, "test", 4, get_recipe("ci").suite)]
    fields = dict(request_id=request_id, sender_path="summ", receiver_path="qa", task=TASK, sender_model="summ",
                  receiver_model="qa", n_train=2, n_test=2, exhaustive=False, other_tasks=[], rows=rows,
                  sender_sha256=in_use.sender_sha256, receiver_sha256=in_use.receiver_sha256)
    return schemas.ProfileRequest(**{**fields, **changes})


def _operator(request_id: str, data_train: str, data_test: str = "test.jsonl") -> schemas.ProfileRequest:
    return schemas.ProfileRequest(request_id=request_id, sender_path="summ", receiver_path="qa", task=TASK,
                                  sender_model="summ", receiver_model="qa", n_train=2, n_test=2, exhaustive=False,
                                  other_tasks=[], data_train=data_train, data_test=data_test)


def _outcome(reply: schemas.ProfileReply | schemas.ErrorReply) -> tuple:
    if isinstance(reply, schemas.ErrorReply):
        return "refused", reply.code, reply.message
    return "published", reply.config.profile_version


async def _versions(url: str, passwords: dict[str, str]) -> list[int]:
    """The versions of summ -> qa the board holds."""
    admin = await _connect(url, "admin", passwords, [])
    try:
        held = await NatsConfigBoard(admin).snapshot() or {}
    finally:
        await admin.close()
    return sorted(c.profile_version for c in held.values()
                  if isinstance(c, schemas.RecomputeConfig) and (c.sender_model, c.receiver_model) == ("summ", "qa"))


def test_a_receivers_request_with_a_path_a_version_or_relay_buckets_is_refused_and_nothing_is_published(mesh, tiny_pair):
    """The operators' subject and another model's re-profile subject are closed to a receiver's
    login (the server refuses the publish); on its own subject, a request naming a data file, a
    robustness file, a checkpoint path, a version, relay buckets or a tolerance other than the
    config in use's (the test split's rule) is refused at once; the board holds the versions it
    held before (other tests of the module may have published some)."""
    url, pw, root, _, _, in_use = mesh
    before = asyncio.run(_versions(url, pw))
    assert in_use.profile_version in before
    ahead = int(time.time()) + 86_000  # would outrank every honest config for a day
    hostile = {
        "version": dict(version=ahead),
        "relay": dict(relay=[schemas.RelayBucket(0.0, 1.0, True)]),
        "data_train": dict(rows=[], data_train=str(root / "train.jsonl"), data_test=str(root / "test.jsonl")),
        "other_tasks": dict(other_tasks=["/dev/zero"]),
        "sender_path": dict(sender_path=str(tiny_pair[0]), sender_model=""),
        "tolerance": dict(tolerance=0.99),  # at 0.99 every plan would pass the test split
    }

    async def run() -> tuple[list[str], dict[str, schemas.ProfileReply | schemas.ErrorReply]]:
        errors: list[str] = []
        rogue = await _connect(url, RECEIVER, pw, errors)
        try:
            for subject in (subjects.PROFILER_PROFILE, subjects.profiler_reprofile("summ")):
                await rogue.publish(subject, schemas.encode(_reprofile(in_use, "as-another", version=ahead)),
                                    reply=rogue.new_inbox())
            await rogue.flush()  # the server has judged both publishes (its errors arrive before the PONG)
            replies = {name: await _ask(rogue, subjects.profiler_reprofile("qa"), _reprofile(in_use, name, **change))
                       for name, change in hostile.items()}
        finally:
            await rogue.close()
        return errors, replies

    errors, replies = asyncio.run(run())
    assert all(isinstance(r, schemas.ErrorReply) and r.code == "bad_request" for r in replies.values()), \
        {name: _outcome(r) for name, r in replies.items()}
    for name, reply in replies.items():
        assert (name in reply.message) if name != "sender_path" else "sender_path must be a model id" in reply.message
    assert str(root) not in " ".join(r.message for r in replies.values() if isinstance(r, schemas.ErrorReply))
    for subject in (subjects.PROFILER_PROFILE, subjects.profiler_reprofile("summ")):
        assert any("permissions violation for publish" in e.lower() and subject in e for e in errors), (subject, errors)
    assert asyncio.run(_versions(url, pw)) == before


def test_a_receivers_reprofile_is_refused_and_recorded_while_an_operators_is_published(mesh):
    """Three well-formed re-profiles at once from the receivers of qa (what their quality watch
    sends): each refused before any work (unauthorized), logged for operators (reprofile_wanted,
    with the user and the pair's version in use, no rows); nothing published. The same request
    from an operator's login is run and published: the profiler picks the version (above the
    newest), runs the search it asks for (the fidelity one, its group capped at 4 layers) and keeps
    the relay buckets of the config in use."""
    url, pw, _, _, profiler, in_use = mesh
    before = asyncio.run(_versions(url, pw))

    async def run() -> tuple[list[schemas.ProfileReply | schemas.ErrorReply], schemas.ProfileReply | schemas.ErrorReply]:
        recv = await _connect(url, RECEIVER, pw, [])
        admin = await _connect(url, "admin", pw, [])
        try:
            asked = await asyncio.gather(*[_ask(recv, subjects.profiler_reprofile("qa"), _reprofile(in_use, f"drift-{i}"))
                                           for i in range(3)])
            return list(asked), await _ask(admin, subjects.profiler_reprofile("qa"),
                                           _reprofile(in_use, "operator", search="fidelity", max_layers=4))
        finally:
            await recv.close()
            await admin.close()

    asked, operator = asyncio.run(run())
    assert all(isinstance(r, schemas.ErrorReply) and r.code == "unauthorized" for r in asked), asked
    assert all(f"{RECEIVER} may ask for a re-profile of summ-to-qa, not have one published" in r.message
               for r in asked if isinstance(r, schemas.ErrorReply))
    wanted = profiler.events("reprofile_wanted")
    assert {e["request_id"] for e in wanted} >= {"drift-0", "drift-1", "drift-2"}
    assert all(e["user"] == RECEIVER and e["pair"].startswith("summ-to-qa v") for e in wanted), wanted
    assert not any(r.startswith("drift-") for e in profiler.events("request") for r in [e.get("request_id", "")])
    assert isinstance(operator, schemas.ProfileReply), operator
    assert operator.config.profile_version > max(before) and operator.config.relay == VETO
    result = json.loads(operator.result_json)
    assert result["search"] == "fidelity"  # the search asked for is the one run, under its cap
    fid = result["fidelity"]
    assert fid["settings"]["max_layers"] == 4 and fid["windows"] and fid["race"]
    assert all(w["recomputed_layers"] <= 4 for w in fid["windows"]) and all(
        e["recomputed_layers"] <= 4 for e in fid["race"])  # no larger group probed or raced
    # 2 rows judge no plan: the profile keeps full prefill (every layer), as it does uncapped
    layers = sum(b - a for a, b in operator.config.chosen.plan.groups)
    assert layers <= 4 or (not fid["decided"] and layers == result["total_layers"]), (layers, fid["race"])
    assert asyncio.run(_versions(url, pw)) == [*before, operator.config.profile_version]


def _failing_rows(tiny_models, root) -> None:
    """train.jsonl / test.jsonl under `root` on which the profile's choice fails its test split:
    train rows where full reuse of the sender's KV answers as the receiver's full prefill does
    (so the fewest recomputed layers, full reuse, is chosen), test rows where it answers
    otherwise; each row's reference answer is the receiver's own full-prefill answer."""
    import torch

    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.tasks.scorer import PairScorer
    from droidmesh.shared.tasks.spec import task_spec

    rows = make_rows(TASK, "test", 24, get_recipe("ci").suite)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the profiler runs (OMP_NUM_THREADS=1): the same sums, the same greedy tokens
    try:
        paths = list(PairScorer(*tiny_models, rows, task_spec(TASK)).paths({"reuse": ReusePlan.full_reuse()},
                                                                         sender_alone=False))
    finally:
        torch.set_num_threads(threads)
    same, other = [], []
    for row, p in zip(rows, paths, strict=True):
        own, reused = p["receiver_full_prefill"].prediction, p["reuse"].prediction
        if own:
            (same if reused == own else other).append({**row, "answers": [own]})
    assert len(same) >= 2 and len(other) >= 6, (len(same), len(other))
    write_jsonl(root / "same.jsonl", same[:2])
    write_jsonl(root / "other.jsonl", other[:6])


def test_a_profile_whose_plan_fails_the_test_split_is_not_published(mesh, tiny_models):
    """An operator's profile whose chosen plan (full reuse, all the train rows support) scores
    below the receiver's full prefill on every test row is refused as `droidmesh config publish`
    refuses it without --force: bad_request naming the failed interval; the board unchanged."""
    url, pw, root, _, profiler, _ = mesh
    _failing_rows(tiny_models, root)
    before = asyncio.run(_versions(url, pw))
    req = msgspec.structs.replace(_operator("fails-test", "same.jsonl", "other.jsonl"), n_test=6)

    async def run() -> schemas.ProfileReply | schemas.ErrorReply:
        admin = await _connect(url, "admin", pw, [])
        try:
            return await _ask(admin, subjects.PROFILER_PROFILE, req)
        finally:
            await admin.close()

    reply = asyncio.run(run())
    assert isinstance(reply, schemas.ErrorReply) and reply.code == "bad_request", _outcome(reply)
    assert reply.message.startswith("summ -> qa: the chosen plan FAILS on test: [-100.0%, -100.0%] against full "
                                    "prefill, 95 % over 6 rows"), reply.message
    assert reply.message.endswith("not published (the receivers keep the pair's current config)")
    # logged before the reply was sent; read from its pipe by a thread of ours, maybe after the reply
    profiler.wait_for(lambda line: '"profile_not_published"' in line, 30, "the profile_not_published line")
    assert [e["request_id"] for e in profiler.events("profile_not_published")] == ["fails-test"]
    assert asyncio.run(_versions(url, pw)) == before


def test_device_files_and_paths_outside_the_data_root_are_refused_like_a_missing_file(mesh):
    """An operator naming /dev/zero, a FIFO, links out of the root, files that exist outside it or
    do not exist anywhere: each refused at once without being read, with the message a missing
    file under the root gets, which names no path."""
    url, pw, root, tmp, profiler, _ = mesh
    names = [str(root / "missing.jsonl"), "missing.jsonl", str(tmp / "outside.jsonl"), "../outside.jsonl",
             "/etc/passwd", "/no/such/dir/rows.jsonl", "escape.jsonl", "zero.jsonl", "/dev/zero", "fifo.jsonl"]

    async def run() -> list[schemas.ProfileReply | schemas.ErrorReply]:
        admin = await _connect(url, "admin", pw, [])
        replies = []
        try:
            for name in names:  # one by one, each compared at once: a profiler reading /dev/zero never answers
                replies.append(await _ask(admin, subjects.PROFILER_PROFILE, _operator(f"trap-{len(replies)}", name),
                                          timeout=120))
                assert _outcome(replies[-1]) == _outcome(replies[0]), (name, replies[-1], replies[0])
        finally:
            await admin.close()
        return replies

    replies = asyncio.run(run())
    first = replies[0]
    assert isinstance(first, schemas.ErrorReply) and first.code == "bad_request", first
    assert first.message == f"data_train: {NOT_ALLOWED}"
    assert not profiler.events("request_crashed")
    assert json.dumps(msgspec.to_builtins(replies)).count(str(tmp)) == 0
