"""Which receivers are up: NATS micro discovery (`$SRV.INFO`), one function for every client.

Each receiver serves its generate endpoint as a NATS micro endpoint whose metadata names the
model (`MODEL_KEY`). `receivers` asks every `droidmesh-receiver` instance for its info, collects
the answers that arrive within `window_s`, and groups the instances by model. Called by the CLI
(`droidmesh ask` with no `--receiver`, `droidmesh receivers`) and the gateway (`GET /v1/models`);
it blocks the caller for `window_s` (an answer cannot say it was the last one). Answers are peer
data: a malformed one, or one naming no model, is skipped, and at most `MAX_INSTANCES` are read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

RECEIVER_SERVICE = "droidmesh-receiver"  # the receivers' micro service name (ServiceRuntime.nats_name)
MODEL_KEY = "model_id"
MAX_INSTANCES = 1024
MAX_MODEL_ID = 256


@dataclasses.dataclass(frozen=True)
class ReceiverModel:
    model_id: str
    instances: tuple[str, ...]  # micro service instance ids, sorted
    version: str


def parse_info(data: bytes) -> list[tuple[str, str, str]]:
    """(model_id, instance id, version) per generate endpoint in one `$SRV.INFO` answer; [] when
    the answer is not a receiver's info."""
    try:
        info = json.loads(data)
    except ValueError:
        return []
    if not isinstance(info, dict) or info.get("name") != RECEIVER_SERVICE:
        return []
    instance, version = str(info.get("id", ""))[:64], str(info.get("version", ""))[:32]
    found = []
    for ep in info.get("endpoints") or []:
        meta = ep.get("metadata") if isinstance(ep, dict) else None
        model = meta.get(MODEL_KEY) if isinstance(meta, dict) else None
        if isinstance(model, str) and 0 < len(model) <= MAX_MODEL_ID:
            found.append((model, instance, version))
    return found


def group(found: list[tuple[str, str, str]]) -> list[ReceiverModel]:
    by_model: dict[str, set[str]] = {}
    versions: dict[str, str] = {}
    for model, instance, version in found:
        by_model.setdefault(model, set()).add(instance)
        versions.setdefault(model, version)
    return [ReceiverModel(m, tuple(sorted(by_model[m])), versions[m]) for m in sorted(by_model)]


async def receivers(nc: Any, window_s: float = 0.5) -> list[ReceiverModel]:
    """Every receiver model answering within `window_s` (a nats-py connection; blocks that long)."""
    found: list[tuple[str, str, str]] = []
    seen = 0

    async def on_info(msg: Any) -> None:
        nonlocal seen
        seen += 1
        if seen <= MAX_INSTANCES:
            found.extend(parse_info(msg.data))

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_info)
    try:
        await nc.publish(f"$SRV.INFO.{RECEIVER_SERVICE}", b"", reply=inbox)
        await nc.flush(timeout=max(0.1, window_s))
        await asyncio.sleep(window_s)  # answers keep arriving until the window closes
    finally:
        await sub.unsubscribe()
    return group(found)
