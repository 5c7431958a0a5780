"""Every change to what goes on the wire bumps `SCHEMA_VERSION`: the structs of `shared.wire`
(bus messages, channel and sandbox messages, generation, log-probabilities), rendered as JSON
schema, hash to the digest pinned here for the version this build speaks. A field added, removed,
renamed or retyped changes the digest; the test then says to bump the version (peers of another
build are then refused at their first message, `SchemaVersionError`, instead of failing one pull
per request) and pin the new digest. A change that keeps the version's digest needs no bump."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import pkgutil

import msgspec

import droidmesh.shared.wire as wire
from droidmesh.shared.wire.schemas import SCHEMA_VERSION

# version -> sha256 of its structs' JSON schema (keep old ones: a reverted bump is caught too)
PINS = {4: "8c6b73fcbe5f1ee7316c0b3b937b91125ffacc08d5fc49f91264ea91922ddf56",
        5: "aea2dc3f590667e09bc161a46d9fd3555edb1ae297ca897ff2f7442fba0fb71d",
        6: "2d8657b4302fb8dc230b42891d2ba35f291f9730e9824a476ea82b059c5c86d4",
        7: "0a9f442bd38c289c72a9120fcaf1931ea55cbe2ad362b9d548f30ba9d7dcd7c8",
        # 8: the same fields; a shm grant says which items are device memory (a receiver of 7
        # would refuse them item by item)
        8: "775ff8f40d40d754e47d596dd5e131c4c301d74d522e086c17e1857ad8cd8123"}


def wire_structs() -> list[type[msgspec.Struct]]:
    """Every msgspec struct defined in a `shared.wire` module, in a stable order."""
    out = []
    for info in sorted(pkgutil.iter_modules(wire.__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"{wire.__name__}.{info.name}")
        out += [obj for _, obj in sorted(vars(mod).items())
                if inspect.isclass(obj) and issubclass(obj, msgspec.Struct) and obj.__module__ == mod.__name__]
    return out


def schema_digest(structs: list[type[msgspec.Struct]]) -> str:
    _, components = msgspec.json.schema_components(structs)
    return hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()


def test_the_wire_schema_is_the_one_pinned_for_its_version():
    structs = wire_structs()
    assert len(structs) >= 40  # the walk found the modules' structs
    digest = schema_digest(structs)
    assert SCHEMA_VERSION in PINS, f"pin version {SCHEMA_VERSION}'s digest: {digest}"
    assert digest == PINS[SCHEMA_VERSION], (
        f"the wire schema changed under version {SCHEMA_VERSION}: bump schemas.SCHEMA_VERSION and pin {digest}")
    assert sorted(PINS) == list(range(min(PINS), SCHEMA_VERSION + 1)), "versions only go up, one at a time"


def test_a_new_field_changes_the_digest():
    """What the pin rests on: adding a defaulted field (as a sliding window's `start` was) is seen."""

    class Item(msgspec.Struct):
        layer: int

    class ItemWithStart(msgspec.Struct):
        layer: int
        start: int = 0

    ItemWithStart.__name__ = "Item"
    assert schema_digest([Item]) != schema_digest([ItemWithStart])
