"""A sender serving finite garbage of the right layout (zeros, sign-flipped, random at the right
scale; `garbage_sender.py`), against a real receiver: checksums and range checks pass it, the
receiver's KV screen does not, so the request falls back to the receiver's own full prefill with
the screen's reason and the same tokens. The control, an honest sender in the same harness, is
reused (partial path: E of layer 1 and the other layers' K/V pulled). Real nats-server, broker,
sender and receiver processes on the ci tier (`test_hostile_senders`' mesh, with the sender on
`summ`: another fine-tune of the receiver `qa`'s base, so the honest cache is a cross-fine-tune one)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from droidmesh.shared.mesh.client import MeshClient
from tests.system.conftest import until_indexed
from tests.system.garbage_sender import KINDS
from tests.system.test_hostile_senders import CONTEXT, RECEIVER_ARGS, _mesh

pytestmark = [pytest.mark.system, pytest.mark.fault, pytest.mark.security]

GARBLER = Path(__file__).with_name("garbage_sender.py")
# Every request relays (the policy's prediction aside) and the breaker never opens: each one pulls.
ARGS = {**RECEIVER_ARGS, "reuse_timeout_s": 30.0, "breaker_failures": 1000, "blind_share": 1.0}
# (kind, what the sender garbles): K/V of every layer, every E, or both
CASES = [("honest", ""), ("zeros", "kv"), ("random", "kv"), ("random", "e"), ("flipped", "all")]
assert {k for k, _ in CASES[1:]} == set(KINDS)


@pytest.mark.parametrize(("kind", "items"), CASES, ids=[f"{k}-{i}" if i else k for k, i in CASES])
def test_garbage_kv_falls_back_to_the_receivers_own_prefill(nats, services, tiny_pair, tiny_models, kind, items):
    """Garbage in every layer's K/V, every E, or both: the reply's path is fallback, its reason
    the screen's, and its tokens the receiver's own full prefill's; an honest sender's cache is reused."""
    url = nats[1]
    wrap = None if kind == "honest" else [sys.executable, str(GARBLER), kind, items, "--"]
    _, receiver = _mesh(services, url, tiny_pair[1], ARGS, {"model_path": tiny_pair[0]}, sender_wrap=wrap)

    async def run():
        client = await MeshClient.connect(url)
        try:
            await client.prefill("sender", CONTEXT)
            await until_indexed(client, tiny_models[1], CONTEXT)
            relayed = await client.ask("receiver", CONTEXT, " q0", max_new_tokens=4, timeout=90)
            own = await client.ask("receiver", CONTEXT, " q0", max_new_tokens=4, mode="full_prefill", timeout=90)
            return relayed, own
        finally:
            await client.close()

    relayed, own = asyncio.run(run())
    assert receiver.popen.poll() is None, receiver.tail()
    assert own.path == "full_prefill" and len(own.token_ids) == 4
    if kind == "honest":
        assert relayed.path == "partial" and relayed.fallback_reason is None and relayed.bytes_pulled > 0, \
            (relayed.path, relayed.fallback_reason)
        return
    # zeros and noise fail at the engine's first read of the item, a sign flip once the request's K/E are in
    what = "direction" if kind == "flipped" else "E of layer 1" if items == "e" else "K of layer 0"
    assert relayed.path == "fallback", (relayed.path, relayed.fallback_reason)
    assert (relayed.fallback_reason or "").startswith(f"integrity: screen: {what}: "), relayed.fallback_reason
    assert relayed.token_ids == own.token_ids
    receiver.wait_for(lambda line: '"reuse_fallback"' in line, 30, "the reuse_fallback line")  # read by a thread of ours
