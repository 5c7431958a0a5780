"""Control-plane alarms: a message refused for what it says (a forged sender, over a cap, another
schema version, a hostile config).

Process-wide and dependency-free, so code at any layer without a `Metrics` at hand (the config
board, message decoding, a service's handlers) can raise one; every service's metrics registry
exports the counts (`shared/service/metrics.py`). Thread-safe: raised from event loops and the
torch thread alike.
"""

from __future__ import annotations

import threading

_ALARMS: dict[tuple[str, str], int] = {}
_ALARMS_LOCK = threading.Lock()


def alarm(kind: str, reason: str) -> None:
    """Count one refused control message of `kind` (message type or subject) for `reason`."""
    with _ALARMS_LOCK:
        _ALARMS[(kind, reason)] = _ALARMS.get((kind, reason), 0) + 1


def alarms() -> dict[tuple[str, str], int]:
    """A copy of the counts so far, by (kind, reason)."""
    with _ALARMS_LOCK:
        return dict(_ALARMS)
