import pytest
import torch

from padless.jagged import JaggedTensor, KeyedJaggedTensor, KeyedTensor, collate_sparse, embedding_bag
from padless.jagged.reference import pad_sparse, padded_pool, random_sparse_samples

KEYS = ["f0", "f1", "f2"]


def _samples():
    return random_sparse_samples(7, KEYS, max_len=6, num_embeddings=20, empty_prob=0.3, seed=3)


def _reference(samples, tables, mode):
    ids, masks = pad_sparse(samples, KEYS)
    return torch.cat([padded_pool(ids[k], masks[k], tables[k], mode) for k in KEYS], dim=1)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_matches_padded_reference_forward_and_backward(mode):
    samples = _samples()
    kjt = collate_sparse(samples, KEYS)
    torch.manual_seed(0)
    tables = {k: torch.randn(20, d, requires_grad=True) for k, d in zip(KEYS, [3, 4, 2])}
    kt = embedding_bag(kjt, tables, mode=mode)
    assert isinstance(kt, KeyedTensor) and kt.keys() == KEYS and kt.length_per_key() == [3, 4, 2]
    ref_tables = {k: t.detach().clone().requires_grad_() for k, t in tables.items()}
    ref = _reference(samples, ref_tables, mode)
    torch.testing.assert_close(kt.values(), ref)
    g = torch.randn_like(ref)
    kt.values().backward(g)
    ref.backward(g)
    for k in KEYS:
        torch.testing.assert_close(tables[k].grad, ref_tables[k].grad)


def test_shared_table_one_call_and_sequence_of_modules():
    samples = _samples()
    kjt = collate_sparse(samples, KEYS)
    w = torch.randn(20, 4)
    shared = embedding_bag(kjt, w, mode="sum")
    per_key = embedding_bag(kjt, [w, w, w], mode="sum")
    torch.testing.assert_close(shared.values(), per_key.values())
    bag = torch.nn.EmbeddingBag(20, 4)
    emb = torch.nn.Embedding(20, 4)
    mods = embedding_bag(kjt, {"f0": bag, "f1": emb, "f2": bag})
    torch.testing.assert_close(mods["f1"], embedding_bag(kjt["f1"], emb.weight).values())


def test_weighted_features():
    kjt = KeyedJaggedTensor(["a"], torch.tensor([1, 2, 3]), torch.tensor([0.5, 2.0, 1.0]), lengths=torch.tensor([2, 0, 1]))
    w = torch.randn(4, 2)
    kt = embedding_bag(kjt, {"a": w})
    torch.testing.assert_close(kt["a"], torch.stack([0.5 * w[1] + 2.0 * w[2], torch.zeros(2), w[3]]))
    plain = embedding_bag(kjt, {"a": w}, per_sample_weights=False)
    torch.testing.assert_close(plain["a"][0], w[1] + w[2])
    over = embedding_bag(kjt, {"a": w}, per_sample_weights=torch.ones(3))
    torch.testing.assert_close(over.values(), plain.values())
    with pytest.raises(ValueError, match="per-sample weights need mode='sum'"):
        embedding_bag(kjt, {"a": w}, mode="mean")
    assert embedding_bag(kjt, {"a": w}, mode="max", per_sample_weights=False)["a"].shape == (3, 2)


def test_jagged_tensor_input():
    jt = JaggedTensor(values=torch.tensor([0, 1, 1]), lengths=torch.tensor([1, 2]))
    w = torch.arange(4.0).view(2, 2)
    kt = embedding_bag(jt, w, mode="mean", key="ids")
    assert kt.keys() == ["ids"] and kt.values().tolist() == [[0.0, 1.0], [2.0, 3.0]]


def test_empty_batch_and_empty_bags():
    kjt = KeyedJaggedTensor(["a", "b"], torch.empty(0, dtype=torch.int64), lengths=torch.zeros(4, dtype=torch.int64))
    kt = embedding_bag(kjt, torch.randn(5, 3))
    assert kt.values().shape == (2, 6) and kt.values().abs().sum() == 0


def test_errors():
    kjt = collate_sparse(_samples(), KEYS)
    w = torch.randn(20, 3)
    with pytest.raises(ValueError, match=r"mode must be one of \('sum', 'mean', 'max'\), got 'min'"):
        embedding_bag(kjt, w, mode="min")
    with pytest.raises(KeyError, match=r"no table for keys \['f2'\]"):
        embedding_bag(kjt, {"f0": w, "f1": w})
    with pytest.raises(ValueError, match=r"2 tables for 3 keys"):
        embedding_bag(kjt, [w, w])
    with pytest.raises(ValueError, match=r"table for 'f0' must be a \(num_embeddings, dim\) tensor"):
        embedding_bag(kjt, {"f0": torch.ones(3), "f1": w, "f2": w})
    with pytest.raises(ValueError, match=r"per_sample_weights must have the shape of values"):
        embedding_bag(kjt, w, per_sample_weights=torch.ones(1))
    with pytest.raises(ValueError, match="per_sample_weights=True but the features carry no weights"):
        embedding_bag(kjt, w, per_sample_weights=True)
    vkjt = KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 1, 1]), stride_per_key_per_rank=[[1], [2]])
    with pytest.raises(ValueError, match=r"keys have different batch sizes \[1, 2\]"):
        embedding_bag(vkjt, w)
    with pytest.raises(TypeError, match="ids must be a 1-D int32/int64 tensor"):
        embedding_bag(JaggedTensor(torch.ones(2), lengths=torch.tensor([2])), w)
    with pytest.raises(TypeError, match="a JaggedTensor takes one table"):
        embedding_bag(JaggedTensor(torch.ones(2, dtype=torch.int64), lengths=torch.tensor([2])), [w])
