"""Codes a sender derives once from a stored tensor (the lowrank codec's SCD codes), found again
for that tensor and for any token prefix of it, and dropped with it.

Found by where the tensor starts (its storage's address and its offset there), not by which
tensor object it is: a placed context's tensors are views of one memfd mapping (`memfd.place`),
and a token prefix of one (`answer._tokens`, a narrow view) starts where it does, with its
strides. Reads and writes are one dict operation each (encodes run on a worker thread, `prepare`
on the torch thread): a race loses an entry at worst.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

Key = tuple[int, int, str]  # (storage address, storage offset, the maps' sha256)


class _Entry(NamedTuple):
    codes: torch.Tensor  # [H, T, r] | [T, r]: token axis 1, or 0 for E
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class PreparedCodes:
    def __init__(self) -> None:
        self._entries: dict[Key, _Entry] = {}

    def put(self, t: torch.Tensor, sha: str, codes: torch.Tensor) -> None:
        """`codes` of the stored tensor `t` under maps `sha`, kept while `t` lives."""
        key, entry = start_of(t, sha), _Entry(codes, tuple(t.shape), t.stride())
        self._entries[key] = entry
        weakref.finalize(t, _forget, self._entries, key, entry)

    def get(self, t: torch.Tensor, kind: str, sha: str) -> torch.Tensor | None:
        """The codes of `t`, when it is a stored tensor given to `put` or a leading token range of
        one (E [1, T, D] and K / V [1, H, T, hd]: tokens on axis 1 or 2), cut to its tokens."""
        entry = self._entries.get(start_of(t, sha))
        if entry is None:
            return None
        axis = 1 if kind == "E" else 2
        shape = entry.shape
        if t.dim() != len(shape) or t.stride() != entry.stride or t.shape[axis] > shape[axis] \
                or t.shape[:axis] != shape[:axis] or t.shape[axis + 1:] != shape[axis + 1:]:
            return None  # not a leading token range of the stored tensor
        return entry.codes.narrow(axis - 1 if kind != "E" else 0, 0, t.shape[axis]).contiguous()

    def __contains__(self, key: object) -> bool:
        return key in self._entries


def start_of(t: torch.Tensor, sha: str) -> Key:
    """Where `t` starts, under maps `sha`: an entry's key."""
    return t.untyped_storage().data_ptr(), int(t.storage_offset()), sha


def _forget(entries: dict[Key, _Entry], key: Key, entry: _Entry) -> None:
    """Drop `entry` (its tensor is gone) unless a later `put` kept another under its key."""
    if entries.get(key) is entry:
        entries.pop(key, None)
