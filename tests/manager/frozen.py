"""What a refused or failed manager operation must leave exactly as it was, as one comparable picture."""

import numpy as np

from tests.support.world import contents


def frozen_state(m, uncounted=("refusals",)):
    """Counters (less ``uncounted``), bytes by device, order, and how each session is held with its contents."""
    stats = m.stats()
    for name in uncounted:
        stats.pop(name)
    held = {
        sid: (
            sorted(h.parked),
            sorted(h.evicted),
            contents(h.session),
            {n: contents(p.obj) for n, p in h.parked.items()},
        )
        for sid, h in m.held().items()
    }
    return stats, m.nbytes_by_device(), list(m.held()), held


def assert_frozen(before, m, uncounted=("refusals",)):
    after = frozen_state(m, uncounted)
    assert after[:3] == before[:3]
    for sid, (parked, dropped, session, parked_contents) in before[3].items():
        now = after[3][sid]
        assert now[:2] == (parked, dropped)
        assert now[2].keys() == session.keys() and all(np.array_equal(now[2][k], session[k]) for k in session)
        for name, arrays in parked_contents.items():
            assert all(np.array_equal(now[3][name][k], arrays[k]) for k in arrays)
