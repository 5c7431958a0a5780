"""Pull grants only for readers of the sender's model: a real nats-server under a rendered roster, a
sender process under its own user, and the receivers' users asking as a receiver does
(`request_grant`). Its own model, a model a pair config on the board names and one in its
`readers` get a grant; another model's receivers are refused, whichever inbox they name."""

from __future__ import annotations

import asyncio
import secrets
import time

import nats
import pytest

from droidmesh.shared import ZOO_DIR
from droidmesh.shared.errors import TransferError
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.mesh.config_board import NatsConfigBoard
from droidmesh.shared.mesh.nats_auth import Roster, password_env, receiver_user, render, sender_user
from droidmesh.shared.service.launch import start_nats, start_service
from droidmesh.shared.transport.pull import request_grant, requester
from droidmesh.shared.wire import schemas, subjects
from tests.system.conftest import words

pytestmark = [pytest.mark.system, pytest.mark.security]

MODEL = ZOO_DIR / "demo" / "summ"  # checked in: no zoo build
SENDER_ID = "s1"
# summ: the sender's own model; qa: in its readers; paired: a pair config names it; intruder: none of these
ROSTER = Roster(senders=((SENDER_ID, "summ"),), receivers=("summ", "qa", "paired", "intruder"))
THREADS = {"OMP_NUM_THREADS": "1"}


def _pair_config() -> schemas.RecomputeConfig:
    """summ -> paired, for other weights than the sender's (a declared pair all the same)."""
    point = schemas.FrontierPoint(schemas.PlanSpec(groups=[(0, 1)]), recomputed_layers=1, quality=0.9)
    return schemas.RecomputeConfig(
        sender_model="summ", receiver_model="paired", sender_sha256="0" * 64, receiver_sha256="1" * 64,
        profile_version=1, task="t", tolerance=0.05, chosen=point, frontier=[point], full_prefill_quality=1.0,
        full_reuse_quality=0.5, total_layers=12, created_at=time.time())


async def _connect(url: str, user: str, passwords: dict[str, str], errors: list[str]):
    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    return await nats.connect(url, user=user, password=passwords[user], error_cb=on_error, max_reconnect_attempts=0,
                              inbox_prefix=subjects.inbox_prefix(user))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """nats-server with ROSTER's users, the pair config on the board, and the sender (readers: qa)
    holding one context; yields (url, passwords, that context's availability event)."""
    passwords = {u: secrets.token_hex(12) for u in ROSTER.users}
    conf = tmp_path_factory.mktemp("nats") / "nats-auth.conf"
    conf.write_text(render(ROSTER))
    proc, url = start_nats(store_dir=str(tmp_path_factory.mktemp("js")), conf=conf,
                           env={password_env(u): p for u, p in passwords.items()})
    sender = None
    try:
        asyncio.run(_put_config(url, passwords))  # as admin: the bucket exists before the sender reads it
        user = sender_user(SENDER_ID)
        sender = start_service("sender", {"model_path": MODEL, "model_id": "summ", "sender_id": SENDER_ID,
                                          "readers": ["qa"]}, url,
                               env={**THREADS, "DM_NATS_USER": user, "DM_NATS_PASSWORD": passwords[user]})
        sender.wait_for(lambda l: '"reader_paired"' in l and '"paired"' in l, 60, "the pair config")
        yield url, passwords, asyncio.run(_prefill(url, passwords))
    finally:
        if sender is not None:
            sender.stop()
        proc.stop()


async def _put_config(url: str, passwords: dict[str, str]) -> None:
    nc = await _connect(url, "admin", passwords, [])
    try:
        await NatsConfigBoard(nc).put(_pair_config())
    finally:
        await nc.close()


async def _prefill(url: str, passwords: dict[str, str]) -> schemas.CacheAvailable:
    """An operator's prefill, and the availability event the sender announced for it."""
    nc = await _connect(url, "admin", passwords, [])
    seen: asyncio.Queue[schemas.CacheAvailable] = asyncio.Queue()

    async def on_available(msg) -> None:
        await seen.put(schemas.decode(msg.data, schemas.CacheAvailable))

    try:
        await nc.subscribe(subjects.cache_available(SENDER_ID), cb=on_available)
        await nc.flush()
        client = await MeshClient.connect(url, user="admin", password=passwords["admin"])
        try:
            reply = await client.prefill("summ", words(60))
        finally:
            await client.close()
        async with asyncio.timeout(30):
            while (ev := await seen.get()).context_id != reply.context_id:
                pass
        return ev
    finally:
        await nc.close()


async def _ask_as(url: str, model: str, passwords: dict[str, str], ev: schemas.CacheAvailable) -> str:
    """`request_grant` as the receivers of `model` ask: the grant, or the refusal's message."""
    nc = await _connect(url, receiver_user(model), passwords, [])
    try:
        return await request_grant(requester(nc), ev, 10)
    except TransferError as e:
        return f"refused: {e}"
    finally:
        await nc.close()


def test_a_grant_goes_only_to_receivers_of_a_model_that_may_read_the_sender(mesh):
    """The sender's own model, the paired model and the reader get a grant; the intruder is refused."""
    url, passwords, ev = mesh

    async def run() -> dict[str, str]:
        return {m: await _ask_as(url, m, passwords, ev) for m in ("summ", "qa", "paired", "intruder")}

    answers = asyncio.run(run())
    for model in ("summ", "qa", "paired"):
        assert not answers[model].startswith("refused"), (model, answers[model])
    assert answers["intruder"].startswith("refused") and "unauthorized" in answers["intruder"], answers["intruder"]
    assert "intruder" in answers["intruder"]


def test_a_grant_is_never_sent_to_a_subject_another_model_can_read(mesh):
    """The intruder asks with its reply on a subject it may subscribe to that is no inbox
    (`$SRV.…`, open to every service for discovery): the sender answers there with a refusal,
    never a grant."""
    url, passwords, ev = mesh

    async def run() -> bytes:
        errors: list[str] = []
        nc = await _connect(url, receiver_user("intruder"), passwords, errors)
        try:
            got: asyncio.Queue[bytes] = asyncio.Queue()

            async def on_reply(msg) -> None:
                await got.put(msg.data)

            grab = f"$SRV.grab.{secrets.token_hex(6)}"
            await nc.subscribe(grab, cb=on_reply)
            await nc.publish(subjects.sender_grant(SENDER_ID), schemas.encode(schemas.GrantRequest(context_id=ev.context_id)),
                             reply=grab)
            await nc.flush()
            async with asyncio.timeout(10):
                data = await got.get()
            assert errors == [], errors  # the server let both through: the refusal is the sender's
            return data
        finally:
            await nc.close()

    data = asyncio.run(run())
    err = schemas.decode(data, schemas.ErrorReply)
    assert err.code == "unauthorized", err
