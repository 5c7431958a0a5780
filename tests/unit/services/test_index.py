"""The broker's index: longest-prefix lookup, compatibility, liveness, eviction."""

from __future__ import annotations

from droidmesh.services.cache_broker.index import BLOCK, CacheIndex
from droidmesh.shared.wire import schemas

FP = schemas.Fingerprint("llama", 2, 8, 2, 2, 4, "{}", "v")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _ev(sender: str, cid: str, tokens: list[int], fp_id: str = "fp", model: str = "m", at: float = 0.0):
    return schemas.CacheAvailable(
        sender_id=sender, model_id=model, fingerprint=FP, fingerprint_id=fp_id, context_id=cid, token_ids=tokens,
        model_sha256="x", dtype="float32", kv_nbytes=[1, 1], e_layers=[0], e_nbytes=1, transport="ucx",
        address="h:1", published_at=at)


def _alive(ix: CacheIndex, sender: str, ids: list[str]) -> None:
    ix.heartbeat(schemas.SenderHeartbeat(sender_id=sender, model_id="m", context_ids=ids, interval_s=1.0, sent_at=0))


def test_longest_prefix_wins():
    """Of two cached contexts, the one sharing the longer token prefix is returned, with its length."""
    ix = CacheIndex()
    base = list(range(100))
    ix.add(_ev("s1", "short", base[:40]))
    ix.add(_ev("s2", "long", base[:90] + [999] * 5))
    _alive(ix, "s1", ["short"])
    _alive(ix, "s2", ["long"])
    holder, n = ix.lookup(base + [7, 8], "fp")
    assert holder is not None and holder.context_id == "long" and n == 90


def test_incompatible_or_excluded_holders_are_skipped():
    """A holder with another fingerprint id or the excluded model is never returned."""
    ix = CacheIndex()
    ix.add(_ev("s1", "c", list(range(64)), fp_id="other"))
    ix.add(_ev("s2", "d", list(range(64)), model="me"))
    _alive(ix, "s1", ["c"])
    _alive(ix, "s2", ["d"])
    assert ix.lookup(list(range(64)), "fp")[0].context_id == "d"  # type: ignore[union-attr]  # a miss fails the test
    assert ix.lookup(list(range(64)), "other")[0].context_id == "c"  # type: ignore[union-attr]  # a miss fails the test
    assert ix.lookup(list(range(64)), "nobody")[0] is None
    assert ix.lookup(list(range(64)), "fp", exclude_model="me")[0] is None


def test_a_holder_of_a_usable_model_wins_over_a_longer_or_newer_one_the_asker_cannot_use():
    """With `models`, their holders beat any other; the others are returned only when none matches."""
    ix = CacheIndex()
    base = list(range(100))
    ix.add(_ev("s1", "usable", base[:60], model="base"))
    ix.add(_ev("s2", "longer", base[:90], model="code"))
    ix.add(_ev("s3", "newer", base[:60], model="code", at=5.0))
    for sender, cid in (("s1", "usable"), ("s2", "longer"), ("s3", "newer")):
        _alive(ix, sender, [cid])
    assert ix.lookup(base, "fp")[0].context_id == "longer"  # type: ignore[union-attr]  # a miss fails the test
    holder, n = ix.lookup(base, "fp", models=["base", "qa"])
    assert holder is not None and holder.context_id == "usable" and n == 60
    assert ix.lookup(base, "fp", models=["qa"])[0].context_id == "longer"  # type: ignore[union-attr]
    assert ix.lookup(base, "fp", models=[f"m{i}" for i in range(5000)])[0] is None  # an oversized list is refused


def test_prefix_shorter_than_a_block_is_not_found():
    """Prompts sharing less than one block with every context find nothing."""
    ix = CacheIndex()
    ix.add(_ev("s1", "c", list(range(64))))
    _alive(ix, "s1", ["c"])
    assert ix.lookup(list(range(BLOCK - 1)) + [500] * 40, "fp") == (None, 0)


def test_dead_senders_expire_and_are_never_served():
    """Without heartbeats a sender's holders are not served, and expire() drops them."""
    clock = Clock()
    ix = CacheIndex(ttl_factor=3.0, clock=clock)
    ix.add(_ev("s1", "c", list(range(64))))
    assert ix.lookup(list(range(64)), "fp")[0] is None  # never heard from: not served
    _alive(ix, "s1", ["c"])
    assert ix.lookup(list(range(64)), "fp")[0] is not None
    clock.t = 10.0
    assert ix.lookup(list(range(64)), "fp")[0] is None
    assert ix.expire() == ["s1"] and len(ix) == 0


def test_eviction_and_heartbeat_reconcile():
    """Evicted contexts and contexts missing from a heartbeat leave the index."""
    ix = CacheIndex()
    ix.add(_ev("s1", "a", list(range(64))))
    ix.add(_ev("s1", "b", list(range(100, 164))))
    ix.remove("s1", "a")
    assert len(ix) == 1
    _alive(ix, "s1", [])
    assert len(ix) == 0


def test_a_returning_sender_is_asked_to_reannounce():
    """A sender dropped for silence that heart-beats again, listing contexts, must re-announce them."""
    now = [0.0]
    ix = CacheIndex(ttl_factor=3.0, clock=lambda: now[0])
    hb = schemas.SenderHeartbeat(sender_id="s", model_id="m", context_ids=["c"], interval_s=1.0, sent_at=0)
    assert ix.heartbeat(hb)  # new, listing a context the index lacks
    ix.add(_ev("s", "c", list(range(32))))
    assert not ix.heartbeat(hb)  # live and indexed: nothing to ask
    now[0] = 10.0
    assert ix.expire() == ["s"] and len(ix) == 0
    assert ix.heartbeat(hb)  # back from the dead: its context must be announced again
