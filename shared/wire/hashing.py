"""Content addresses of token sequences, torch-free (the broker imports this, never torch).

A context is named by its token ids alone, so a sender, a broker and a receiver that saw the
same tokens agree on its id without talking to each other.
"""

from __future__ import annotations

import array

import xxhash


def context_id(token_ids: tuple[int, ...] | list[int]) -> str:
    """Content address of a context: xxh3-128 of its token ids as little-endian uint32."""
    arr = array.array("I", token_ids)
    return xxhash.xxh3_128_hexdigest(arr.tobytes())


def common_prefix(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """Length of the longest common prefix of two token-id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
