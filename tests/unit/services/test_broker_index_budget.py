"""The broker index's byte budgets and bounded work per event: what a holder is charged bounds what
it holds, a sender over its budget loses its own oldest holders, a full index refuses newcomers,
and keying only the first blocks of a context changes no lookup's answer."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest
import xxhash

from droidmesh.services.cache_broker.index import BLOCK, CacheIndex, Limits, Refused, block_keys
from droidmesh.shared.wire import schemas

FP = schemas.Fingerprint("llama", 2, 8, 2, 2, 4, "{}", "v")


def _ev(sender: str, cid: str, tokens: list[int], at: float = 0.0, **kw) -> schemas.CacheAvailable:
    fields = dict(sender_id=sender, model_id="m", fingerprint=FP, fingerprint_id="fp", context_id=cid, token_ids=tokens,
                  model_sha256="x" * 64, dtype="bfloat16", kv_nbytes=[1 << 20] * 32, e_layers=[0, 4], e_nbytes=1,
                  transport="ucx", address="127.0.0.1:5000", published_at=at)
    return schemas.CacheAvailable(**{**fields, **kw})


def _alive(ix: CacheIndex, sender: str) -> None:
    held = list(ix._holders.get(sender, {}))
    ix.heartbeat(schemas.SenderHeartbeat(sender_id=sender, model_id="m", context_ids=held, interval_s=1.0, sent_at=0))


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1000 + rng.getrandbits(31) for _ in range(n)]  # getrandbits: ~5x randrange's speed


@pytest.mark.parametrize("shape", ["long", "short", "wide_metadata"])
def test_what_a_holder_is_charged_bounds_what_the_index_holds(shape):
    """The bytes the index charges its holders are at least what they take (tracemalloc), and not
    wildly more: the budgets bound memory, not a proxy of it."""
    n, kw = {"long": (1 << 16, {}), "short": (40, {}),
             "wide_metadata": (512, {"kv_nbytes": [1 << 40] * 4096, "model_id": "m" * 200,
                                     "fingerprint": schemas.Fingerprint("llama", 2, 8, 2, 2, 4, "r" * 50_000, "v")})}[shape]
    payloads = [schemas.encode(_ev("s", f"c{i}", _tokens(n, i), **kw)) for i in range(12)]
    ix = CacheIndex()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for data in payloads:  # decoded here and dropped: only what the index keeps stays traced
            ix.add(schemas.decode(data, schemas.CacheAvailable))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= ix.nbytes <= 3 * held + 12 * 4096, (held, ix.nbytes)


def test_a_sender_over_its_byte_budget_loses_its_own_oldest_holders():
    """Past its budget a sender's oldest-announced holders go (a re-announced one counts as new);
    another sender's are untouched, and the sender stays within its budget."""
    probe = CacheIndex()  # one holder's size, on a scratch index
    probe.add(_ev("s1", "x", _tokens(256, 0)))
    size = probe.nbytes
    ix = CacheIndex(limits=Limits(max_sender_bytes=3 * size + size // 2))
    ix.add(_ev("other", "o", _tokens(256, 99)))
    dropped = [ix.add(_ev("s1", f"c{i}", _tokens(256, i))) for i in range(3)]
    ix.add(_ev("s1", "c0", _tokens(256, 0)))  # re-announced: now the newest
    dropped += [ix.add(_ev("s1", f"c{i}", _tokens(256, i))) for i in (3, 4)]
    assert dropped == [0, 0, 0, 1, 1]
    assert list(ix._holders["s1"]) == ["c0", "c3", "c4"]
    assert list(ix._holders["other"]) == ["o"] and ix.sender_bytes("s1") <= ix.limits.max_sender_bytes
    _alive(ix, "s1")
    assert ix.lookup(_tokens(256, 1), "fp")[0] is None  # evicted: no longer served
    assert ix.lookup(_tokens(256, 4), "fp")[0].context_id == "c4"  # type: ignore[union-attr]  # a miss fails the test


def test_a_full_index_refuses_a_newcomer_and_never_evicts_another_sender():
    """Over the whole index's budget, a sender makes room out of its own holders only; one with
    none to give up is refused; a holder larger than a budget is refused outright."""
    probe = CacheIndex()
    probe.add(_ev("a", "x", _tokens(256, 0)))
    size = probe.nbytes
    ix = CacheIndex(limits=Limits(max_index_bytes=2 * size + size // 2))
    ix.add(_ev("a", "a0", _tokens(256, 0)))
    ix.add(_ev("a", "a1", _tokens(256, 1)))
    with pytest.raises(Refused) as e:
        ix.add(_ev("b", "b0", _tokens(256, 2)))
    assert e.value.reason == "index_full" and len(ix) == 2
    assert ix.add(_ev("a", "a2", _tokens(256, 3))) == 1 and list(ix._holders["a"]) == ["a1", "a2"]
    with pytest.raises(Refused) as e:
        ix.add(_ev("a", "huge", _tokens(4096, 4)))
    assert e.value.reason == "too_large" and list(ix._holders["a"]) == ["a1", "a2"]


def test_removing_every_holder_gives_back_every_byte_and_key():
    ix = CacheIndex()
    base = _tokens(300, 0)
    for i in range(5):
        ix.add(_ev(f"s{i % 2}", f"c{i}", base[: 100 + 40 * i]))
    ix.add(_ev("s0", "c0", base[:200]))  # re-announced with other token ids
    for sid, held in list(ix._holders.items()):
        for cid in list(held):
            ix.remove(sid, cid)
    assert ix.nbytes == 0 and len(ix) == 0 and not ix._by_key and ix.sender_bytes("s0") == 0


def test_only_the_first_blocks_are_keyed_and_lookups_still_find_the_longest_prefix():
    """With 2 blocks keyed, contexts sharing far more than 2 blocks are told apart token by token:
    the longest exact prefix wins, and the reply carries the holder's token ids in full."""
    ix = CacheIndex(limits=Limits(max_indexed_blocks=2))
    base = _tokens(10 * BLOCK, 0)
    ix.add(_ev("s1", "shorter", base[: 5 * BLOCK] + [1] * 40))
    ix.add(_ev("s2", "longer", base[: 7 * BLOCK + 3] + [2] * 40))
    ix.add(_ev("s3", "other", _tokens(10 * BLOCK, 1)))
    assert all(len(h.keys) == 2 for held in ix._holders.values() for h in held.values())
    for s in ("s1", "s2", "s3"):
        _alive(ix, s)
    holder, n = ix.lookup(base, "fp")
    assert holder is not None and holder.context_id == "longer" and n == 7 * BLOCK + 3
    assert holder.token_ids == base[: 7 * BLOCK + 3] + [2] * 40
    holder, n = ix.lookup(base[: 6 * BLOCK], "fp")
    assert holder is not None and n == 6 * BLOCK


def test_block_keys_hash_each_chained_block_of_4_byte_little_endian_ids():
    ids = _tokens(5 * BLOCK + 7, 3)
    h, expected = xxhash.xxh3_64(), []
    for i in range(5):
        h.update(b"".join(t.to_bytes(4, "little") for t in ids[i * BLOCK : (i + 1) * BLOCK]))
        expected.append(h.intdigest())
    assert block_keys(ids) == expected and block_keys(ids, limit=3) == expected[:3]


@pytest.mark.parametrize("tokens", [[-1] * 20, [1 << 32] * 20, [], list(range(1 << 18)) + [1]])
def test_token_ids_out_of_range_or_count_are_refused_and_never_found(tokens):
    ix = CacheIndex()
    with pytest.raises(Refused) as e:
        ix.add(_ev("s", "c", tokens))
    assert e.value.reason == "bad_field" and len(ix) == 0 and ix.nbytes == 0
    assert ix.lookup(tokens, "fp") == (None, 0)


def test_per_layer_lists_longer_than_any_model_are_refused():
    with pytest.raises(Refused):
        CacheIndex().add(_ev("s", "c", _tokens(64, 0), kv_nbytes=[1] * 100_000))
