"""Fuzzing every wire decoder and every request handler: no crash, every reply well formed."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from droidmesh.services.cache_broker.config import BrokerConfig
from droidmesh.services.cache_broker.service import BrokerService
from droidmesh.services.profiler.config import ProfilerConfig
from droidmesh.services.profiler.service import ProfilerService
from droidmesh.services.receiver.config import ReceiverConfig
from droidmesh.services.receiver.service import ReceiverService
from droidmesh.services.sender.config import SenderConfig
from droidmesh.services.sender.service import SenderService
from droidmesh.shared.bus import InProcessBus
from droidmesh.shared.config_board import InMemoryConfigBoard
from droidmesh.shared.errors import BadMessageError
from droidmesh.shared.wire import schemas, subjects

pytestmark = pytest.mark.fuzz

MESSAGES = [c for c in vars(schemas).values()
            if isinstance(c, type) and issubclass(c, schemas.Message) and c is not schemas.Message]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=40), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=5)),
                      max_leaves=20)


def _maps_like(kind: type) -> st.SearchStrategy[bytes]:
    """msgpack maps with the message's tag and field names but arbitrary values."""
    fields = {f: values for f in kind.__struct_fields__ if f != "v"}
    tag = st.sampled_from([kind.__struct_config__.tag, "nope", 7])
    version = st.sampled_from([1, 1, 2, "1", None])
    return st.fixed_dictionaries({"type": tag, "v": version}, optional=fields).map(msgspec.msgpack.encode)


any_bytes = st.one_of(st.binary(max_size=300), values.map(msgspec.msgpack.encode))


@pytest.mark.parametrize("kind", MESSAGES, ids=lambda k: k.__name__)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(any_bytes, st.deferred(lambda: st.sampled_from(MESSAGES).flatmap(_maps_like))))
def test_decoders_raise_only_bad_message(kind, data):
    """Every decoder either returns a typed message or raises a BadMessageError subclass."""
    try:
        msg = schemas.decode(data, kind)
    except BadMessageError:
        return
    assert isinstance(msg, kind)


@pytest.fixture(scope="module")
def wired(tiny_pair, tiny_models):
    """Every service wired on one in-process bus, on a loop the fuzz examples reuse."""
    loop = asyncio.new_event_loop()
    bus, board = InProcessBus(), InMemoryConfigBoard()
    sender_m, receiver_m = tiny_models
    stack = [
        BrokerService(BrokerConfig(), bus=bus),
        SenderService(SenderConfig(model_path=str(tiny_pair[0]), model_id="sender", store_bytes=1 << 22),
                      bus=bus, model=sender_m, board=board),
        ReceiverService(ReceiverConfig(model_path=str(tiny_pair[1]), model_id="receiver", default_group=(2, 4),
                                       reuse_timeout_s=2), bus=bus, model=receiver_m, board=board),
        ProfilerService(ProfilerConfig(max_rows=2), bus=bus, board=board),
    ]
    for svc in stack:
        loop.run_until_complete(svc.__aenter__())
    yield loop, bus
    for svc in reversed(stack):
        loop.run_until_complete(svc.__aexit__(None, None, None))
    loop.close()


ENDPOINTS = {
    subjects.BROKER_LOOKUP: (schemas.LookupRequest, schemas.LookupReply),
    subjects.sender_generate("sender"): (schemas.GenerateRequest, schemas.GenerateReply),
    subjects.sender_prefill("sender"): (schemas.PrefillRequest, schemas.PrefillReply),
    subjects.receiver_generate("receiver"): (schemas.GenerateRequest, schemas.GenerateReply),
    subjects.PROFILER_PROFILE: (schemas.ProfileRequest, schemas.ProfileReply),
}
texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=60)
requests = st.one_of(
    st.builds(schemas.LookupRequest, token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=80), fingerprint_id=texts),
    st.builds(schemas.GenerateRequest, request_id=texts, context=texts, question=texts,
              max_new_tokens=st.integers(-3, 4), deadline=st.sampled_from([0.0, 1.0, 1e12]),
              mode=st.sampled_from([*schemas.MODES, "bogus"]), ttft_slo_ms=st.floats(0, 1e4)),
    st.builds(schemas.PrefillRequest, request_id=texts, context=texts),
    st.builds(schemas.ProfileRequest, request_id=texts, sender_path=texts, receiver_path=texts, task=texts,
              n_train=st.integers(-1, 3), n_test=st.integers(-1, 3), granularity=st.integers(-1, 3)),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(subject=st.sampled_from(sorted(ENDPOINTS)), data=st.one_of(any_bytes, requests.map(schemas.encode)))
def test_handlers_always_reply_well_formed(wired, subject, data):
    """Any bytes to any endpoint get a decodable reply: the endpoint's reply type or an
    ErrorReply with a code; the services keep serving."""
    loop, bus = wired
    reply = loop.run_until_complete(bus.request(subject, data, timeout=60))
    _, reply_kind = ENDPOINTS[subject]
    try:
        schemas.decode(reply, reply_kind)
    except BadMessageError:
        err = schemas.decode(reply, schemas.ErrorReply)
        assert err.code and err.code != "internal", err
