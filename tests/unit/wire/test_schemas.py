"""Wire schemas: round trips and a specific error for every kind of bad message."""

from __future__ import annotations

import msgspec
import pytest

from droidmesh.shared.errors import BadMessageError, SchemaVersionError
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.generation import GenerateRequest


def _req(**kw):
    return GenerateRequest(**{"request_id": "r", "context": "c", "question": "q", **kw})


def test_round_trip():
    """encode -> decode gives the same message, with type tag and version on the wire."""
    msg = _req(max_new_tokens=7)
    raw = msgspec.msgpack.decode(schemas.encode(msg))
    assert raw["type"] == "generate.request" and raw["v"] == schemas.SCHEMA_VERSION
    assert schemas.decode(schemas.encode(msg), GenerateRequest) == msg


@pytest.mark.parametrize(
    "data,error,match",
    [
        (b"\xc1", BadMessageError, "not msgpack"),
        (msgspec.msgpack.encode([1, 2]), BadMessageError, "expected a msgpack map"),
        (msgspec.msgpack.encode({"type": "generate.request", "v": 99}), SchemaVersionError, "schema version 99"),
        (msgspec.msgpack.encode({"type": "generate.request", "v": schemas.SCHEMA_VERSION, "request_id": 5,
                                 "context": "c", "question": "q"}),
         BadMessageError, r"request_id"),
        (msgspec.msgpack.encode({"type": "lookup.request", "v": schemas.SCHEMA_VERSION, "token_ids": [], "fingerprint_id": "x"}),
         BadMessageError, "invalid GenerateRequest"),
        (b"\x80" + b"\x00" * (schemas.MAX_MESSAGE_BYTES + 1), BadMessageError, "exceeds"),
    ],
    ids=["undecodable", "not-a-map", "version", "field-type", "wrong-kind", "oversize"],
)
def test_bad_messages_raise_specific_errors(data, error, match):
    """Each malformed input raises its own BadMessageError subclass, naming the problem."""
    with pytest.raises(error, match=match):
        schemas.decode(data, GenerateRequest)


@pytest.mark.parametrize("field, value", [("mode", "partial"), ("mode", "warp")])
def test_closed_sets_are_refused_at_decode(field, value):
    """Modes are a closed set: the retired `partial` alias and unknown names are bad messages."""
    with pytest.raises(BadMessageError, match=f"Invalid enum value '{value}'"):
        schemas.decode(schemas.encode(_req(**{field: value})), GenerateRequest)


def test_decoders_are_built_once_per_kind():
    """Decoding the same kind twice reuses one msgspec decoder."""
    schemas.decode(schemas.encode(_req()), GenerateRequest)
    first = schemas._DECODERS[GenerateRequest]
    schemas.decode(schemas.encode(_req()), GenerateRequest)
    assert schemas._DECODERS[GenerateRequest] is first
