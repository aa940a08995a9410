"""A structure remembers what it worked out with its contraction partners without keeping them
(issue 39): a long-lived query met by a new key every step keeps no key alive, its caches stay
bounded, and a partner that died (its ``id`` free for a new structure) is never taken for a
new one."""

import gc
import weakref

import pytest
import torch

import padless
from padless.ops.common import partners
from padless.ops.pairs import contract
from padless.tensor.errors import StructureError
from padless.tensor.structure import StructureMeta


def _batch(lens, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return padless.from_list([torch.randn(n, d, generator=g, dtype=torch.float64) for n in lens])


def _derived_entries(meta):
    """Entries of a structure's caches, counting those inside its per-partner LRU maps."""
    return sum(len(v) if isinstance(v, dict) else 1 for v in meta.derived.values())


def _live_structures():
    return sum(type(o) is StructureMeta for o in gc.get_objects())


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_long_lived_query_keeps_no_key_alive(grad):
    q = _batch([3, 0, 5, 1]).requires_grad_(grad)
    steps = 3 * contract.CHECKED_SIZE
    grown, entries = [], []
    gc.collect()
    before = _live_structures()
    for step in range(steps):
        lens = [1 + (step + 2 * i) % 7 + step // 7 for i in range(4)]  # never the same sizes twice
        k = _batch(lens, seed=step)
        kt = k.transpose(-1, -2)
        s = q @ kt  # (Q_i, K_i) scores
        v = _batch(lens, seed=100 + step)
        o = s @ v  # contracts the keys' ragged dim
        for i, (qi, ki, vi) in enumerate(zip(q.unbind(), k.unbind(), v.unbind())):
            torch.testing.assert_close(s[i], qi @ ki.T)
            torch.testing.assert_close(o[i], (qi @ ki.T) @ vi)
        if grad:
            o.values().sum().backward()
        del k, kt, s, v, o
        entries.append(_derived_entries(q._meta))
        if step % 8 == 7:
            gc.collect()
            grown.append(_live_structures() - before)
    # the old code kept every key (and its caches) met: +2 structures a step, and as many entries
    assert max(grown) <= 4, f"structures kept alive by a long-lived query, every 8 steps: {grown}"
    assert max(entries) <= 8, entries


def test_a_dead_partner_is_never_taken_for_a_new_one():
    """Alternate keys whose extents fit and keys whose extents clash: a clash raises every time,
    whether or not the new key's metadata landed at a freed address."""
    q = _batch([2, 3])
    for step in range(6):  # each step collects garbage twice (a full gc is ~0.3 s here)
        good = _batch([2, 3], seed=step)
        s = q @ good.transpose(-1, -2)  # (2, 2), (3, 3)
        del good
        gc.collect()
        bad = _batch([3, 2], seed=step)  # the scores' key dim (2, 3) against values of (3, 2)
        with pytest.raises(StructureError, match=r"matmul\(\): ragged structures differ: sample 0 contracts dims of extents 2 and 3"):
            s @ bad
        del bad, s
        gc.collect()


def test_the_weak_cache_misses_once_a_partner_died_and_is_bounded():
    owner, p = StructureMeta(), StructureMeta()
    partners.put(owner, "slot", "k", [p], "value", size=4)
    assert partners.get(owner, "slot", "k", [p]) == "value"
    ref = weakref.ref(p)
    del p
    gc.collect()
    assert ref() is None
    fresh = [StructureMeta() for _ in range(8)]  # one of them may take the freed address
    assert all(partners.get(owner, "slot", "k", [f]) is None for f in fresh)
    for i, f in enumerate(fresh):
        partners.put(owner, "slot", i, [f], i, size=4)
    assert len(owner.derived["slot"]) == 4
    assert [partners.get(owner, "slot", i, [f]) for i, f in enumerate(fresh)][-4:] == [4, 5, 6, 7]
