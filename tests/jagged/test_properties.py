"""Property tests: dense lists round-trip through every type unchanged."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import padless
from padless.jagged import JaggedTensor, KeyedJaggedTensor, KeyedTensor, collate_sparse, embedding_bag

ids = st.lists(st.integers(0, 49), max_size=6)
bags = st.lists(ids, max_size=6)
keys = st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=4, unique=True)


@settings(max_examples=60, deadline=None)
@given(bags)
def test_jagged_tensor_round_trips(rows):
    jt = JaggedTensor.from_dense([torch.tensor(r, dtype=torch.int64) for r in rows])
    assert [t.tolist() for t in jt.to_dense()] == rows
    assert jt.offsets().tolist() == [sum(map(len, rows[:i])) for i in range(len(rows) + 1)]
    n = max(map(len, rows), default=0)
    assert jt.to_padded_dense(padding_value=-1).tolist() == [r + [-1] * (n - len(r)) for r in rows]
    back = JaggedTensor.from_dense_lengths(jt.to_padded_dense(padding_value=-1), jt.lengths())
    assert [t.tolist() for t in back.to_dense()] == rows
    via_offsets = JaggedTensor(values=jt.values(), offsets=jt.offsets())
    assert [t.tolist() for t in via_offsets.to_dense()] == rows
    if rows:
        nt = jt.to_nested()
        assert [s.tolist() for s in nt.unbind()] == rows
        assert [t.tolist() for t in JaggedTensor.from_nested(nt).to_dense()] == rows
        assert [s.tolist() for s in padless.from_values(jt.values(), jt.offsets().long()).unbind()] == rows


@settings(max_examples=60, deadline=None)
@given(keys.flatmap(lambda ks: st.tuples(st.just(ks), st.lists(st.fixed_dictionaries({k: ids for k in ks}), max_size=5))))
def test_keyed_jagged_round_trips(case):
    ks, samples = case
    kjt = collate_sparse(samples, ks)
    expected = {k: [s[k] for s in samples] for k in ks}
    dense = {k: [t.tolist() for t in jt.to_dense()] for k, jt in kjt.to_dict().items()}
    assert dense == expected
    assert kjt.length_per_key() == [sum(len(s[k]) for s in samples) for k in ks]
    rt = KeyedJaggedTensor.from_jt_dict(kjt.to_dict())
    assert {k: [t.tolist() for t in jt.to_dense()] for k, jt in rt.to_dict().items()} == expected
    perm = list(reversed(range(len(ks))))
    p = kjt.permute(perm)
    assert {k: [t.tolist() for t in jt.to_dense()] for k, jt in p.to_dict().items()} == expected
    assert p.keys() == [ks[i] for i in perm]
    parts = kjt.split([1, len(ks) - 1])
    cat = KeyedJaggedTensor.concat(parts)
    assert {k: [t.tolist() for t in jt.to_dense()] for k, jt in cat.to_dict().items()} == expected
    lengths = torch.tensor([len(s[k]) for k in ks for s in samples], dtype=torch.int64)
    synced = KeyedJaggedTensor.from_lengths_sync(ks, kjt.values(), lengths, stride=len(samples))
    assert synced.offset_per_key() == kjt.offset_per_key()


@settings(max_examples=40, deadline=None)
@given(keys.flatmap(lambda ks: st.tuples(st.just(ks), st.lists(st.fixed_dictionaries({k: ids for k in ks}), min_size=1, max_size=5))))
def test_pooled_keyed_tensor_round_trips(case):
    ks, samples = case
    kjt = collate_sparse(samples, ks)
    w = torch.arange(50.0)[:, None].repeat(1, 2)
    kt = embedding_bag(kjt, w, mode="sum")
    for k in ks:
        assert kt[k][:, 0].tolist() == [float(sum(s[k])) for s in samples]
    kt2 = KeyedTensor.from_tensor_list(list(kt.to_dict()), list(kt.to_dict().values()))
    assert torch.equal(kt2.values(), kt.values())
    (whole,) = KeyedTensor.regroup([kt], [ks])
    assert torch.equal(whole, kt.values())
