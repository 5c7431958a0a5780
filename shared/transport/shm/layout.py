"""How an item lies in shared memory, as both sides of the shm channel count it: one row per
leading index before the token axis (a K / V head; E has one), each row its tokens x the trailing
dims. Pure; a grant's regions are rows at a stride, so a prefix pull (fewer tokens than stored)
reads each row's first bytes without a copy on the sender.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from droidmesh.shared.transport.bulk import token_axis

MAX_FDS = 8  # memfds one grant may carry (a sender passes at most two: placed + per-pull)


def rows(shape: Sequence[int], kind: str, element_size: int) -> tuple[int, int]:
    """(rows, bytes per row) of an item of `shape`."""
    axis = token_axis(kind)
    return math.prod(shape[:axis]), math.prod(shape[axis:]) * element_size
