import pickle

import pytest
import torch

import padless
from padless.jagged import JaggedTensor, KeyedJaggedTensor


def _kjt(weighted: bool = True) -> KeyedJaggedTensor:
    # "a": [1,2] [] [3]   "b": [4] [5] [6,7,8]   "c": [] [9] []
    v = torch.arange(1, 10)
    return KeyedJaggedTensor(
        ["a", "b", "c"], v, v.float() / 10 if weighted else None, lengths=torch.tensor([2, 0, 1, 1, 1, 3, 0, 1, 0])
    )


def _dense(kjt: KeyedJaggedTensor) -> dict[str, list[list[int]]]:
    return {k: [t.tolist() for t in jt.to_dense()] for k, jt in kjt.to_dict().items()}


A = [[1, 2], [], [3]]
B = [[4], [5], [6, 7, 8]]
Cc = [[], [9], []]


def test_host_metadata_is_precomputed():
    kjt = _kjt()
    assert kjt.length_per_key_or_none() is None  # construction is lazy, as in TorchRec
    assert kjt.validate() is kjt
    assert kjt.length_per_key_or_none() == [3, 5, 1]  # host lengths: known once checked, no sync
    assert kjt.offset_per_key_or_none() == [0, 3, 8, 9]
    assert kjt.lengths_offset_per_key() == [0, 3, 6, 9]
    assert kjt.offsets_or_none() is None and kjt.offsets().tolist() == [0, 2, 2, 3, 4, 5, 8, 8, 9, 9]
    assert kjt.unsync().length_per_key_or_none() is None
    assert kjt.sync().length_per_key_or_none() == [3, 5, 1]


def test_getitem_and_to_dict_are_views():
    kjt = _kjt()
    b = kjt["b"]
    assert isinstance(b, JaggedTensor)
    assert [t.tolist() for t in b.to_dense()] == B
    assert b.values().data_ptr() == kjt.values()[3:].data_ptr()
    torch.testing.assert_close(b.weights(), torch.tensor([0.4, 0.5, 0.6, 0.7, 0.8]))
    assert _dense(kjt) == {"a": A, "b": B, "c": Cc}
    assert kjt.to_dict() is kjt.to_dict()
    with pytest.raises(KeyError, match=r"no key 'z'; keys are \['a', 'b', 'c'\]"):
        kjt["z"]


def test_permute():
    kjt = _kjt()
    p = kjt.permute([2, 0, 1])
    assert p.keys() == ["c", "a", "b"]
    assert _dense(p) == {"c": Cc, "a": A, "b": B}
    assert p.lengths().tolist() == [0, 1, 0, 2, 0, 1, 1, 1, 3]
    assert p.length_per_key() == [1, 3, 5]
    torch.testing.assert_close(p["a"].weights(), torch.tensor([0.1, 0.2, 0.3]))
    dup = kjt.permute([1, 1])  # repeating a key is allowed, as in TorchRec
    assert dup.keys() == ["b", "b"] and dup.values().tolist() == [4, 5, 6, 7, 8] * 2
    with pytest.raises(IndexError, match=r"index 3 is out of range for 3 keys"):
        kjt.permute([3])


def test_split():
    parts = _kjt().split([1, 0, 2])
    assert [p.keys() for p in parts] == [["a"], [], ["b", "c"]]
    assert _dense(parts[0]) == {"a": A}
    assert _dense(parts[2]) == {"b": B, "c": Cc}
    assert parts[2].offset_per_key() == [0, 5, 6]
    assert parts[1].values().numel() == 0 and parts[1].stride() == 3
    with pytest.raises(ValueError, match=r"segments \[1, 1\] must be >= 0 and sum to the 3 keys"):
        _kjt().split([1, 1])


def test_concat_and_from_jt_dict_round_trip():
    kjt = _kjt()
    a, bc = kjt.split([1, 2])
    cat = KeyedJaggedTensor.concat([a, bc])
    assert cat.keys() == ["a", "b", "c"] and _dense(cat) == _dense(kjt)
    assert cat.length_per_key_or_none() == [3, 5, 1]
    rt = KeyedJaggedTensor.from_jt_dict(kjt.to_dict())
    assert _dense(rt) == _dense(kjt)
    torch.testing.assert_close(rt.weights(), kjt.weights())
    with pytest.raises(ValueError, match="cannot mix weighted and unweighted"):
        KeyedJaggedTensor.concat([_kjt(True), _kjt(False)])
    e = KeyedJaggedTensor.concat([KeyedJaggedTensor.empty(), _kjt(False)])
    assert not e.variable_stride_per_key() and e.stride() == 3 and _dense(e) == _dense(_kjt())
    with pytest.raises(ValueError, match="needs at least one"):
        KeyedJaggedTensor.concat([])


def test_variable_stride_per_key():
    kjt = KeyedJaggedTensor(
        ["x", "y"], torch.arange(6), lengths=torch.tensor([1, 2, 0, 2, 1]), stride_per_key_per_rank=[[2], [1, 2]]
    )
    assert kjt.variable_stride_per_key()
    assert kjt.stride_per_key() == [2, 3] and kjt.stride() == 3
    assert kjt.stride_per_key_per_rank() == [[2], [1, 2]] and _kjt().stride_per_key_per_rank() == []
    assert kjt.length_per_key() == [3, 3]
    assert _dense(kjt) == {"x": [[0], [1, 2]], "y": [[], [3, 4], [5]]}
    p = kjt.permute([1, 0])
    assert p.stride_per_key_per_rank() == [[1, 2], [2]] and _dense(p) == {"y": [[], [3, 4], [5]], "x": [[0], [1, 2]]}
    s = kjt.split([1, 1])
    assert s[1].stride_per_key() == [3] and _dense(s[1]) == {"y": [[], [3, 4], [5]]}
    c = KeyedJaggedTensor.concat([kjt, _kjt(False)])  # mixed strides: the result has a variable stride
    assert c.stride_per_key() == [2, 3, 3, 3, 3] and c.keys() == ["x", "y", "a", "b", "c"]
    assert _dense(c)["b"] == B
    e = KeyedJaggedTensor.empty_like(kjt)  # TorchRec: no keys, the per-key-per-rank strides kept
    assert e.keys() == [] and e.stride_per_key_per_rank() == [[2], [1, 2]] and e.values().numel() == 0


def test_empty_and_empty_like():
    e = KeyedJaggedTensor.empty(is_weighted=True)
    assert e.keys() == [] and e.stride() == 0 and e.values().numel() == 0 and e.weights().numel() == 0
    assert e.length_per_key() == [] and e.offset_per_key() == [0] and e.to_dict() == {}
    el = KeyedJaggedTensor.empty_like(_kjt())  # TorchRec: no keys, the batch size kept
    assert el.keys() == [] and el.stride() == 3 and el.to_dict() == {}
    assert el.weights().numel() == 0 and el.values().dtype == torch.int64
    dl = KeyedJaggedTensor.empty_like(_kjt(), device="meta")  # same keys and shapes, new storage
    assert dl.keys() == ["a", "b", "c"] and dl.values().shape == (9,) and dl.device().type == "meta"
    assert dl.length_per_key() == [3, 5, 1]


def test_from_sync_constructors():
    k = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.arange(3), torch.tensor([1, 0, 2, 0]))
    assert k.length_per_key_or_none() == [1, 2]
    k2 = KeyedJaggedTensor.from_offsets_sync(["a", "b"], torch.arange(3), torch.tensor([0, 1, 1, 3, 3]))
    assert k2.offset_per_key_or_none() == [0, 1, 3]


def test_moves_carry_host_metadata_no_sync():
    kjt = _kjt().to("meta", dtype=torch.float16)  # meta tensors cannot be read back: proves no host read
    assert kjt.device() == torch.device("meta") and kjt.weights().dtype == torch.float16
    assert kjt.length_per_key() == [3, 5, 1] and kjt.offset_per_key() == [0, 3, 8, 9]
    assert kjt["b"].values().shape == (5,)
    assert [t.shape[0] for t in kjt["b"].to_dense()] == [1, 1, 3]
    assert kjt.permute([2, 1]).length_per_key() == [1, 5]
    assert [p.length_per_key() for p in kjt.split([2, 1])] == [[3, 5], [1]]
    assert KeyedJaggedTensor.concat(kjt.split([2, 1])).offset_per_key() == [0, 3, 8, 9]


def test_device_built_without_host_metadata_syncs_only_on_request():
    # built from a device's tensors (meta here): nothing is known on the host until sync()
    kjt = KeyedJaggedTensor(["a", "b"], torch.empty(3, device="meta"), lengths=torch.empty(4, dtype=torch.int64, device="meta"))
    assert kjt.length_per_key_or_none() is None and kjt.stride() == 2
    # meta data cannot be read: sync() splits the values evenly over the keys, as TorchRec does
    assert kjt.sync().length_per_key() == [2, 1] and kjt.offset_per_key() == [0, 2, 3]
    assert {k: j.values().shape[0] for k, j in kjt.to_dict().items()} == {"a": 2, "b": 1}


# checked at construction: types, counts and strides (no data read)
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 1, 1])), r"keys and lengths disagree: 3 lengths cannot be split evenly over 2 keys"),
        (dict(keys=["a"], values=torch.arange(3), lengths=torch.tensor([1, 1, 1]), stride=2), r"keys and lengths disagree: 1 keys x stride 2 = 2 lengths expected, got 3"),
        (dict(keys=["a"], values=torch.arange(3), lengths=torch.tensor([1, 2]), stride_per_key_per_rank=[[1], [1]]), "stride_per_key_per_rank has 2 entries but there are only 1 keys"),
        (dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 2]), stride_per_key_per_rank=[[1]]), r"stride_per_key_per_rank \[\[1\]\] needs 1 lengths, got 2"),
        (dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 2]), stride_per_key_per_rank=[[1], [2]]), r"keys and lengths disagree: stride_per_key_per_rank \[\[1\], \[2\]\] needs 3 lengths, got 2"),
        (dict(keys=["a"], values=torch.arange(3), lengths=torch.tensor([3]), stride_per_key=[2]), r"stride_per_key \[2\] disagrees with the strides \[1\]"),
        (dict(keys=["a"], values=torch.arange(3), lengths=torch.tensor([3]), lengths_offset_per_key=[0, 2]), r"lengths_offset_per_key \[0, 2\] disagrees with the strides \(which give \[0, 1\]\)"),
        (dict(keys=[], values=torch.arange(3), lengths=torch.tensor([3])), "keys and lengths disagree: no keys but 1 lengths"),
        (dict(keys=[1], values=torch.arange(3), lengths=torch.tensor([3])), "keys must be strings"),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        KeyedJaggedTensor(**kwargs)


# the structure is checked on first need (construction is lazy, as in TorchRec); a fault raises in
# what reads values through it
DEFERRED = [
    (dict(keys=["a", "b"], values=torch.arange(3), weights=torch.ones(2), lengths=torch.tensor([1, 2])), "the lengths cover 3 rows but weights has only 2"),
    (dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 2]), length_per_key=[3]), r"keys and length_per_key disagree: 2 keys, 1 lengths \[3\]"),
    (dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 2]), length_per_key=[2, 3]), r"length_per_key \[2, 3\] sums to 5 but values has 3 rows"),
    (dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 2]), offset_per_key=[0, 4]), r"offset_per_key must have len\(keys\) \+ 1 = 3 entries from 0 to at most 3, got \[0, 4\]"),
    (dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 3])), "the lengths cover 4 rows but values has only 3"),
    (dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([2, -1, 1, 1])), r"lengths must be >= 0, but lengths\[1\] = -1"),
    (dict(keys=["a", "b"], values=torch.arange(3), offsets=torch.tensor([0, 2, 1])), r"offsets must not decrease, but offsets\[1\] = 2 > offsets\[2\] = 1"),
    (dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 2]), length_per_key=[2, 1]), r"length_per_key \[2, 1\] disagrees with lengths \(which give \[1, 2\]\)"),
    (dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 2]), offset_per_key=[0, 2, 3]), r"offset_per_key \[0, 2, 3\] disagrees with lengths \(which give \[0, 1, 3\]\)"),
    (dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 2]), length_per_key=[4, -1]), r"length_per_key must give every key >= 0 values, but key 'b' has -1 \(length_per_key \[4, -1\]\)"),
    (dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 2]), offset_per_key=[0, 3, 2]), r"offset_per_key must give every key >= 0 values, but key 'b' has -1 \(offset_per_key \[0, 3, 2\]\)"),
]
FIRST_USES = {
    "validate": lambda k: k.validate(),
    "padless.jagged.validate": padless.jagged.validate,
    "to_dict": lambda k: k.to_dict(),
    "getitem": lambda k: k["a"],
    "permute": lambda k: k.permute([1, 0]),
    "split": lambda k: k.split([1, 1]),
    "host_offsets": lambda k: k.host_offsets(),
    "str": str,
    "embedding_bag": lambda k: padless.jagged.embedding_bag(k, torch.ones(9, 2)),
    "after to(meta)": lambda k: k.to("meta").to_dict(),  # the fault travels with the moved copy
}


@pytest.mark.parametrize("use", list(FIRST_USES))
@pytest.mark.parametrize("kwargs, match", DEFERRED)
def test_structure_errors_on_first_use(kwargs, match, use):
    kjt = KeyedJaggedTensor(**kwargs)  # lazy: types, counts and strides only
    for _ in range(2):  # an invalid structure stays invalid: asked again, it raises again
        with pytest.raises(padless.StructureError, match=match):
            FIRST_USES[use](kjt)


@pytest.mark.parametrize("kwargs, match", DEFERRED)
def test_a_fault_does_not_stop_what_torchrec_accepts(kwargs, match):
    # TorchRec accepts these KJTs; what only passes the tensors along works on them, as there
    kjt = KeyedJaggedTensor(**kwargs)
    lengths, offsets = kwargs.get("lengths"), kwargs.get("offsets")
    assert kjt.lengths().tolist() == (lengths.tolist() if lengths is not None else offsets.diff().tolist())
    assert kjt.offsets().tolist() == (offsets.tolist() if offsets is not None else [0, *lengths.cumsum(0).tolist()])
    # per-key lists: as given, else TorchRec's per-key sums of the lengths
    opk = kwargs.get("offset_per_key")
    lpk = kwargs.get("length_per_key") or (opk and torch.tensor(opk).diff().tolist()) or kjt.lengths().view(2, -1).sum(1).tolist()
    assert kjt.sync() is kjt and kjt.length_per_key() == lpk
    assert kjt.offset_per_key() == (opk or [0, *torch.tensor(lpk).cumsum(0).tolist()])
    moved = kjt.to("meta")
    assert moved.keys() == kjt.keys() and moved.length_per_key() == kjt.length_per_key()
    c = KeyedJaggedTensor(["c"], torch.arange(kjt.stride()), torch.ones(kjt.stride()) if "weights" in kwargs else None, lengths=torch.ones(kjt.stride(), dtype=torch.int64))
    both = KeyedJaggedTensor.concat([kjt, c])  # joined as they are, as TorchRec joins them
    assert torch.equal(both.values(), torch.cat([kjt.values(), c.values()])) and both.keys() == ["a", "b", "c"]
    with pytest.raises(padless.StructureError, match=match):
        kjt.validate()
    with pytest.raises(padless.StructureError, match="KeyedJaggedTensor: "):  # the joined KJT is faulty too
        both.validate()


def test_negative_length_per_key_is_refused_on_a_device_too():
    """Device lengths are trusted and never read, but a given per-key list is host data: a
    negative width is a fault there too (it used to pass ``validate()``)."""
    kjt = KeyedJaggedTensor(
        ["a", "b"], torch.arange(3, device="meta"), lengths=torch.tensor([1, 2], device="meta"), length_per_key=[4, -1]
    )
    with pytest.raises(padless.StructureError, match=r"length_per_key must give every key >= 0 values, but key 'b' has -1"):
        kjt.validate()


DUPLICATE = r"keys must be unique, but 'a' is keys\[0\] and keys\[2\] \(keys \['a', 'b', 'a'\]\); a dict by key would keep only one"


@pytest.mark.parametrize(
    "use, op",
    [
        (lambda k: k.validate(), r"KeyedJaggedTensor.validate\(\)"),
        (padless.jagged.validate, r"KeyedJaggedTensor.validate\(\)"),
        (lambda k: k.to_dict(), r"KeyedJaggedTensor.to_dict\(\)"),
        (lambda k: k["b"], r"KeyedJaggedTensor\['b'\]"),
        (lambda k: k.index_per_key(), r"KeyedJaggedTensor.index_per_key\(\)"),
    ],
)
def test_duplicate_keys_are_refused_where_a_key_addresses_them(use, op):
    """TorchRec's validator refuses repeated keys; its to_dict keeps one silently. Both refuse here."""
    kjt = KeyedJaggedTensor(["a", "b", "a"], torch.arange(4), lengths=torch.tensor([1, 0, 2, 1, 0, 0]))
    with pytest.raises(padless.StructureError, match=op + ": " + DUPLICATE):
        use(kjt)


def test_repeated_keys_stay_positional():
    """``permute`` with a repeated index repeats a key (as in TorchRec); what addresses keys by
    position works on it, what addresses them by name refuses."""
    kjt = _kjt(weighted=False).permute([0, 1, 0])
    assert kjt.keys() == ["a", "b", "a"] and kjt.length_per_key() == [3, 5, 3]
    assert kjt.values().tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    left, right = kjt.split([2, 1])
    assert right.keys() == ["a"] and right.to_dict()["a"].values().tolist() == [1, 2, 3]
    pooled = padless.jagged.embedding_bag(kjt, torch.arange(10.0).view(10, 1))
    assert pooled.values()[:, 0].tolist() == pooled.values()[:, 2].tolist() == [3.0, 0.0, 3.0]
    with pytest.raises(padless.StructureError, match=r"KeyedJaggedTensor.to_dict\(\): keys must be unique, but 'a'"):
        kjt.to_dict()


def test_concat_of_a_short_part_joins_the_values_as_they_are():
    # values split at other points than the keys (TorchRec's own concat test): each part alone is
    # unreadable (the first has a tail, the second is short), the joined KJT is sound
    values = torch.arange(1.0, 10.0)
    lengths = torch.tensor([0, 2, 0, 1, 1, 1, 0, 3, 0, 0, 1, 0], dtype=torch.int32)
    parts = [
        KeyedJaggedTensor.from_lengths_sync(["a"], values[:4], lengths[:4]),
        KeyedJaggedTensor.from_lengths_sync(["b", "c"], values[4:], lengths[4:]),
    ]
    with pytest.raises(padless.StructureError, match="the lengths cover 6 rows but values has only 5"):
        parts[1].to_dict()
    cat = KeyedJaggedTensor.concat(parts)
    whole = KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], values, lengths)
    assert torch.equal(cat.values(), values) and torch.equal(cat.offsets(), whole.offsets())
    assert cat.length_per_key() == whole.length_per_key() == [3, 5, 1]
    assert {k: [t.tolist() for t in j.to_dense()] for k, j in cat.to_dict().items()} == {
        k: [t.tolist() for t in j.to_dense()] for k, j in whole.to_dict().items()
    }
    jts = {"a": JaggedTensor(values[:4], lengths=lengths[:4]), "b": JaggedTensor(values[4:8], lengths=lengths[4:8])}
    joined = KeyedJaggedTensor.from_jt_dict(jts)  # "b" is short: joined as they are, as TorchRec joins them
    assert torch.equal(joined.values(), values[:8]) and joined.validate().length_per_key() == [3, 5]


def test_given_per_key_lists_stay_as_given():
    # TorchRec keeps them (and compares them in kjt_is_equal); padless raises only where values are read
    kjt = KeyedJaggedTensor(["a", "b"], torch.arange(8.0), offsets=torch.tensor([0, 0, 2, 2, 3, 4, 5, 5, 8]), length_per_key=[4, 4], offset_per_key=[0, 4])
    assert kjt.sync().length_per_key() == [4, 4] and kjt.offset_per_key() == [0, 4]
    with pytest.raises(padless.StructureError, match=r"offset_per_key must have len\(keys\) \+ 1 = 3 entries"):
        kjt["a"]


def test_derived_lengths_and_offsets_are_checked_first():
    # the check reads the tensors given, so a derived one never changes the fault reported
    k = KeyedJaggedTensor(["a"], torch.arange(3), offsets=torch.tensor([0, 2, 1]))
    assert k.lengths().tolist() == [2, -1]
    with pytest.raises(padless.StructureError, match=r"offsets must not decrease"):
        k.validate()
    # tensors on a device are trusted (never read back), as in TorchRec
    meta = KeyedJaggedTensor(["a"], torch.empty(3, device="meta"), lengths=torch.empty(2, dtype=torch.int64, device="meta"))
    assert meta.validate() is meta and meta.length_per_key_or_none() is None


def test_from_jt_dict_checks_lazily_built_jagged_tensors():
    bad = {"a": JaggedTensor(torch.arange(3), lengths=torch.tensor([2, 2]))}
    kjt = KeyedJaggedTensor.from_jt_dict(bad)  # accepted, as TorchRec accepts it; reading it raises
    assert kjt.length_per_key() == [4] and kjt.lengths().tolist() == [2, 2]
    with pytest.raises(padless.StructureError, match="the lengths cover 4 rows but values has only 3"):
        kjt.to_dict()


def test_from_jt_dict_weight_mismatch():
    with pytest.raises(ValueError, match="some JaggedTensors have weights and some do not"):
        KeyedJaggedTensor.from_jt_dict(
            {
                "a": JaggedTensor(torch.arange(2), torch.ones(2), lengths=torch.tensor([2])),
                "b": JaggedTensor(torch.arange(2), lengths=torch.tensor([2])),
            }
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinning, streams, device moves)")
def test_cuda_pin_move_record_stream():
    kjt = _kjt().pin_memory()
    assert kjt.values().is_pinned() and kjt.lengths().is_pinned() and kjt.weights().is_pinned()
    g = kjt.to(torch.device("cuda"), non_blocking=True)
    g.record_stream(torch.cuda.current_stream())
    assert g.length_per_key() == [3, 5, 1]
    assert _dense(g) == _dense(_kjt())
    assert _dense(g.permute([2, 0, 1])) == _dense(_kjt().permute([2, 0, 1]))


@pytest.mark.parametrize("lengths_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("variable", [False, True])
def test_deferred_host_offsets_agree_with_offsets(lengths_dtype, variable):
    # permute/split/concat of host KJTs leave the bag offsets to one cumsum on first need
    g = torch.Generator().manual_seed(0)
    spkpr = [[3], [2, 2], [0], [5]] if variable else None
    n = 12  # 3 + 4 + 0 + 5 bags, or 4 keys x 3
    lengths = torch.randint(0, 4, (n,), generator=g, dtype=lengths_dtype)
    kw = dict(stride_per_key_per_rank=spkpr) if variable else dict(stride=3)
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b", "c", "d"], torch.arange(int(lengths.sum())), lengths, **kw)
    made = [kjt, kjt.permute([3, 0, 2]), *kjt.split([1, 3]), KeyedJaggedTensor.concat(kjt.split([2, 2]))]
    made += [pickle.loads(pickle.dumps(k)) for k in made]  # as DataLoader workers send them
    for k in made:
        ref = torch.cat([torch.zeros(1, dtype=torch.int64), k.lengths().long().cumsum(0)])
        assert k.offsets().dtype == lengths_dtype and k.offsets().tolist() == ref.tolist()
        assert k.host_offsets().tolist() == ref.tolist()
        assert k.offset_per_key() == ref[k.lengths_offset_per_key()].tolist()
        assert _dense(k) == {key: _dense(kjt)[key] for key in k.keys()}
