"""Compose's vLLM receiver, run as compose runs it: the `vllm-qa` service's own command (vLLM's
OpenAI server with DroidMesh's connector on the demo tier's `qa`) against a real mesh — a
nats-server with per-role users, a broker and a DroidMesh sender of `summ` as processes, the demo's
summ -> qa profile published — with only what a container changes mapped to this host: the models
folder, the NATS URL (no TLS here), the password file, the address and port it listens on. A
request over a context the sender holds is served `partial` under the profile's plan, pulled
over the service's own bulk channel (ucx)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from droidmesh.shared.engines.vllm.client import ServedEngine
from droidmesh.shared.kv.policy import plan_of
from droidmesh.shared.mesh.nats_auth import Roster
from droidmesh.shared.model import text
from droidmesh.shared.model.adapter import load_model
from droidmesh.shared.model.names import ModelRef
from droidmesh.shared.service.launch import free_port, start_service
from droidmesh.shared.service.localmesh import NO_HEALTH_PORT, THREADS, connect_as, mesh, publish_configs, start_sender
from droidmesh.shared.tools.apps.serve_config import load_config
from tests.system.conftest import until_indexed, vllm_python, words

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "infra" / "compose.yaml"
DEMO = ROOT / "zoo" / "demo"
SERVICE = "vllm-qa"
CONTEXT = words(300)
QUESTION = " what is the first word"
READY_S = 600.0


def compose_command(url: str, password_file: Path, port: int) -> tuple[list[str], dict[str, Any]]:
    """The service's command with what a container changes mapped here, and its connector config."""
    svc = yaml.safe_load(COMPOSE.read_text())["services"][SERVICE]
    args = [str(a) for a in svc["command"]]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    extra = config["kv_connector_extra_config"]
    assert extra["nats_url"].startswith("tls://") and extra.pop("nats_tls_ca")  # compose's NATS is TLS; this one is not
    extra.update(nats_url=url, nats_password_file=str(password_file),
                 models={m: p.replace("/models", str(DEMO), 1) for m, p in extra["models"].items()})
    args[args.index("--kv-transfer-config") + 1] = json.dumps(config)
    args = [a.replace("/models", str(DEMO), 1) if a.startswith("/models/") else a for a in args]
    args[args.index("--host") + 1], args[args.index("--port") + 1] = "127.0.0.1", str(port)
    return args, extra


def test_composes_vllm_service_reuses_the_senders_context_under_the_published_plan(tmp_path):
    python = vllm_python()
    cfg = load_config(str(DEMO / "profiles" / "summ-to-qa.json"))
    plan = plan_of(cfg.chosen.plan)
    roster = Roster(senders=(("summ", "summ"),), receivers=("qa",))
    with mesh(roster) as (access, procs):
        asyncio.run(publish_configs([cfg], access))
        procs.append(start_service("cache_broker", {}, access.url, env={**THREADS, **NO_HEALTH_PORT,
                                                                        **access.env_for("broker")}, log_dir=tmp_path))
        procs.append(start_sender(access, ModelRef(DEMO / "summ", "summ"), "summ", plan.e_layers, tmp_path,
                                  {**THREADS, **NO_HEALTH_PORT}, paired=["qa"], transport="ucx"))
        password = tmp_path / "nats-password"
        password.write_text(access.password("receiver-qa"))
        port = free_port()
        args, extra = compose_command(access.url, password, port)
        assert extra["nats_user"] == "receiver-qa" and extra["transport"] == "ucx"
        engine = ServedEngine(python, {"name": "qa"}, tmp_path, port, args=args,
                              env={**THREADS, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"})
        try:
            receiver = load_model(DEMO / "qa", device="cpu", dtype="float32", name="qa")

            async def hold() -> None:
                (client,) = await connect_as(access, "admin")  # filling a sender is an operator's job
                try:
                    await client.prefill("summ", CONTEXT, timeout=120.0)
                    await until_indexed(client, receiver, CONTEXT)
                finally:
                    await client.close()

            asyncio.run(hold())
            engine.ready(READY_S)
            ctx, q = text.prompt_ids(receiver.tokenizer, CONTEXT, QUESTION)
            got = engine.ask("compose", ctx + q, max_tokens=4)
            (decided,) = engine.events("request", got["request_id"])
            assert decided["path"] == "partial" and decided["plan"] == plan.label(), decided
            assert decided["reused_tokens"] == len(ctx), decided
            (loaded,) = engine.events("loaded", got["request_id"])
            assert loaded["bytes_pulled"] > 0, loaded
            assert not engine.events("reuse_fallback", got["request_id"]) and len(got["tokens"]) == 4
        finally:
            engine.stop()
