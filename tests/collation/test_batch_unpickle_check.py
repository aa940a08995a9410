"""A collated Batch checks its NestedTensors' structure when unpickled (issue 25, item 8):
a forged or corrupted pickle from a worker raises instead of handing ops offsets that read
out of bounds. The check is O(B) and vectorised."""

from __future__ import annotations

import pickle
import time

import pytest
import torch

import padless
from padless import StructureError


def _batch(n: int = 4) -> padless.collation.Batch:
    c = padless.Collator({"ids": padless.Field(ragged=0, position_ids="pos")})
    return c([{"ids": torch.arange(i + 1)} for i in range(n)])


def test_a_sound_batch_round_trips() -> None:
    b = _batch()
    r = pickle.loads(pickle.dumps(b))
    assert r.ids.values().tolist() == b.ids.values().tolist() and r.ids.shape == b.ids.shape
    assert r.ids._meta is r.pos._meta  # fields that shared a structure share it again


@pytest.mark.parametrize(
    "forge, msg",
    [
        (lambda nt: nt._offsets.__setitem__(2, 7), r"host_offsets \[0, 1, 3, 6, 10\] differs from offsets \[0, 1, 7, 6, 10\]"),
        (lambda nt: (nt._offsets.__setitem__(2, 7), nt._meta.host_offsets.__setitem__(2, 7)), r"offsets decrease at sample 2: offsets\[2\]=7 > offsets\[3\]=6"),
        (lambda nt: nt._sizes.__setitem__((1, 0), 5), r"host_sizes \[\[1\], \[2\], \[3\], \[4\]\] differs from sizes \[\[1\], \[5\], \[3\], \[4\]\]"),
        (lambda nt: (nt._sizes.__setitem__((3, 0), 9), nt._meta.host_sizes.__setitem__((3, 0), 9)), r"sample 3 spans offsets\[3:5\] = 6\.\.10 \(4 rows\), but its shape \(9,\) needs 9"),
    ],
    ids=["offsets_vs_host", "decreasing", "sizes", "host_sizes"],
)
def test_a_forged_pickle_is_refused(forge, msg) -> None:
    b = _batch()
    nt = b.ids
    nt._meta.host_offsets = nt._meta.host_offsets.clone()  # forge the parts independently of each other
    nt._meta.host_sizes = nt._meta.host_sizes.clone()
    forge(nt)
    blob = pickle.dumps(b)
    with pytest.raises(StructureError, match=r"NestedTensor \(unpickled\): (" + msg + ")"):
        pickle.loads(blob)


def test_the_check_is_cheap() -> None:
    c = padless.Collator({"ids": padless.Field(ragged=0)})
    blob = pickle.dumps(c([{"ids": torch.arange(i % 50 + 1)} for i in range(512)]))
    pickle.loads(blob)
    t0 = time.perf_counter()
    for _ in range(20):
        pickle.loads(blob)
    per = (time.perf_counter() - t0) / 20
    assert per < 0.05, f"unpickling a 512-sample batch took {per * 1e3:.1f} ms"
