"""The reuse timing side channel stays shut with holding on: `bench sidechannel --holding`'s
suite on the ci tier (a real mesh with per-role users, a broker, a holding receiver, the keyed
gateway). The victim tenant's own requests are held by the receiver; another tenant asks for the
same contexts or fresh ones and times each answer. Its requests for the victim's contexts are
never served from them (every path `full_prefill`), and its best threshold rule's accuracy on
the test half stays within chance.

The gate on accuracy uses a 99.9 % Wilson interval, not the bench's 95 %: at chance, a 95 %
interval's lower bound exceeds 0.5 in about one run in 40, and CI must not fail that often on a
machine that leaks nothing. A leak as large as the one scopes closed (the bench's "before" phase,
every cached request `full_reuse`, accuracy 1.0) fails it at any interval."""

from __future__ import annotations

import pytest

from droidmesh.shared.tasks.intervals import wilson
from droidmesh.shared.tools.bench import sidechannel as suite

pytestmark = [pytest.mark.system, pytest.mark.security]

TRIALS = 40  # per label: 40 of the 80 timed requests test the rule
Z999 = 3.29


def test_another_tenant_cannot_tell_the_victims_held_contexts_by_timing(tiny_pair):
    _, receiver = tiny_pair
    setup = suite.Setup(str(receiver), str(receiver), (1, 2), holding=True, phases=("after",))
    result = suite.run_sidechannel(setup, words=300, trials=TRIALS, warmup=1, seed=0, say=lambda _: None)
    after = result["phases"]["after"]
    assert after["paths"]["cached"] == {"full_prefill": TRIALS}, after["paths"]
    assert after["paths"]["uncached"] == {"full_prefill": TRIALS}, after["paths"]
    lo, hi = wilson(after["test_correct"], after["test_trials"], z=Z999)
    assert after["test_trials"] == TRIALS and lo <= 0.5, (after["accuracy"], lo, hi)
