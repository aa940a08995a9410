"""The Hugging Face path without transformers: labels the samples carry, output collisions,
``hf_kwargs`` flags and :class:`padless.FlatteningCollator` (issue 14, items 1-6).
``test_hf_transformers.py`` runs the same objects against real transformers models."""

from __future__ import annotations

import pytest
import torch

import padless
from padless import NestedTensor


def _features():
    return [
        {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8], "attention_mask": [1, 1, 1, 1]},
        {"input_ids": [9, 10], "labels": [9, 10], "attention_mask": [1, 1]},
        {"input_ids": [11, 12, 13], "labels": [-100, 12, 13], "attention_mask": [1, 1, 1]},
    ]


# ---------------------------------------------------------------------------- item 1: user labels


def test_labels_the_samples_carry_are_kept_with_the_separator_on_top():
    c = padless.Collator({"input_ids": padless.Field(ragged=0, labels="labels")})
    b = c(_features())
    # prompt tokens stay masked; each sample's first label is the separator
    assert b.labels.values().tolist() == [-100, -100, 7, 8, -100, 10, -100, 12, 13]
    assert b.labels.offsets().tolist() == b.input_ids.offsets().tolist()
    without = c([{k: v for k, v in f.items() if k != "labels"} for f in _features()])
    assert without.labels.values().tolist() == [-100, 6, 7, 8, -100, 10, -100, 12, 13]


def test_own_labels_must_match_the_tokens():
    feats = _features()
    feats[1]["labels"] = [9]
    c = padless.Collator({"input_ids": padless.Field(ragged=0, labels="labels")})
    with pytest.raises(ValueError, match=r"field 'input_ids': sample 1's own 'labels' has shape \(1,\), its 'input_ids' has \(2,\)"):
        c(feats)
    feats = [{"input_ids": torch.tensor([1, 2]), "labels": torch.tensor([0.5, 1.0])}]
    with pytest.raises(TypeError, match=r"sample 0's own 'labels' has dtype torch.float32"):
        c(feats)


def test_other_outputs_never_overwrite_a_sample_field():
    c = padless.Collator({"input_ids": padless.Field(ragged=0, position_ids="position_ids")})
    feats = [{"input_ids": [1, 2], "position_ids": [0, 1]}]
    with pytest.raises(ValueError, match=r"field 'input_ids': the position_ids output 'position_ids' would overwrite the samples' own 'position_ids'"):
        c(feats)
    c = padless.Collator({"input_ids": padless.Field(ragged=0, seq_idx="attention_mask")})
    with pytest.raises(ValueError, match=r"the seq_idx output 'attention_mask' would overwrite"):
        c(_features())


# ---------------------------------------------------------------------------- item 2: hf_kwargs flags


def test_hf_kwargs_use_cache_and_block_mask():
    b = padless.Collator({"input_ids": padless.Field(ragged=0)})([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    kw = b.hf_kwargs("input_ids")
    assert kw["use_cache"] is False and "attention_mask" not in kw
    enc = b.hf_kwargs("input_ids", causal=False, block_mask=True)
    assert "use_cache" not in enc
    mask = enc["attention_mask"]
    low = torch.finfo(torch.float32).min
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.float32
    keep = (mask[0, 0] == 0).int().tolist()
    assert keep == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]
    assert mask[0, 0, 0, 4] == low
    causal = b.hf_kwargs("input_ids", block_mask=True, mask_dtype=torch.bfloat16)["attention_mask"]
    assert causal.dtype == torch.bfloat16
    assert (causal[0, 0] == 0).int().tolist()[4] == [0, 0, 0, 1, 1] and (causal[0, 0] == 0).int().tolist()[3] == [0, 0, 0, 1, 0]


# ---------------------------------------------------------------------------- items 3-6: FlatteningCollator


def test_flattening_collator_output():
    out = padless.FlatteningCollator()(_features())
    assert set(out) == {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                        "max_length_q", "max_length_k", "use_cache"}
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]] and out["input_ids"].dtype == torch.int64
    assert out["labels"].tolist() == [[-100, -100, 7, 8, -100, 10, -100, 12, 13]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2]]
    assert out["cu_seq_lens_q"].tolist() == [0, 4, 6, 9] and out["cu_seq_lens_q"].dtype == torch.int32
    assert out["max_length_q"] == out["max_length_k"] == 4 and isinstance(out["max_length_q"], int)
    assert out["use_cache"] is False
    assert not any(isinstance(v, NestedTensor) for v in out.values())


def test_flattening_collator_options():
    feats = [{"input_ids": torch.tensor([1, 2, 3], dtype=torch.int32)}, {"input_ids": torch.tensor([4, 5])}]
    c = padless.FlatteningCollator(separator_id=-1, position_ids_start=2, return_seq_idx=True,
                                   return_flash_attn_kwargs=False, causal=False, block_mask=True)
    out = c(feats)
    assert set(out) == {"input_ids", "labels", "position_ids", "seq_idx", "attention_mask"}
    assert out["labels"].tolist() == [[-1, 2, 3, -1, 5]] and out["position_ids"].tolist() == [[2, 3, 4, 2, 3]]
    assert out["seq_idx"].tolist() == [[0, 0, 0, 1, 1]] and out["seq_idx"].dtype == torch.int32
    assert c(feats, separator_id=-7)["labels"].tolist() == [[-7, 2, 3, -7, 5]]
    assert "position_ids" not in padless.FlatteningCollator(return_position_ids=False)(feats)


def test_flattening_collator_drops_empty_samples_as_transformers_does():
    feats = [{"input_ids": [1, 2]}, {"input_ids": []}, {"input_ids": [3]}]
    out = padless.FlatteningCollator(return_seq_idx=True)(feats)
    assert out["cu_seq_lens_q"].tolist() == [0, 2, 3] and out["seq_idx"].tolist() == [[0, 0, 1]]
    with pytest.raises(ValueError, match=r"every feature's 'input_ids' is empty \(2 features\)"):
        padless.FlatteningCollator()([{"input_ids": []}, {"input_ids": torch.empty(0, dtype=torch.int64)}])


def test_flattening_collator_equal_lengths_and_one_sample():
    out = padless.FlatteningCollator()([{"input_ids": [1, 2]}, {"input_ids": [3, 4]}])
    assert out["input_ids"].shape == (1, 4) and out["cu_seq_lens_q"].tolist() == [0, 2, 4]
    one = padless.FlatteningCollator()([{"input_ids": [7]}])
    assert one["input_ids"].tolist() == [[7]] and one["labels"].tolist() == [[-100]]


def test_flattening_collator_errors():
    c = padless.FlatteningCollator()
    with pytest.raises(TypeError, match=r"feature 1 has keys \['ids'\]; every feature needs a 'input_ids' key"):
        c([{"input_ids": [1]}, {"ids": [2]}])
    with pytest.raises(TypeError, match=r"feature 0's 'input_ids' is a Tensor of shape \(1, 2\); it needs a list"):
        c([{"input_ids": torch.ones(1, 2, dtype=torch.int64)}])
    with pytest.raises(ValueError, match=r"return_tensors='np'; only 'pt' is supported"):
        c([{"input_ids": [1]}], return_tensors="np")
    with pytest.raises(TypeError, match=r"expected a list of features, got dict"):
        c({"input_ids": [1]})
    with pytest.raises(KeyError, match=r"feature 1 has no 'labels' but earlier features have them"):
        c([{"input_ids": [1], "labels": [1]}, {"input_ids": [2]}])
    with pytest.raises(KeyError, match=r"feature 2 has 'labels' but earlier features have none"):
        c([{"input_ids": [1]}, {"input_ids": []}, {"input_ids": [2], "labels": [2]}])


def test_flattening_collator_in_a_dataloader_with_workers():
    feats = [{"input_ids": list(range(1, n + 1))} for n in (3, 5, 2, 4)]
    loader = torch.utils.data.DataLoader(feats, batch_size=2, collate_fn=padless.FlatteningCollator(), num_workers=1)
    batches = list(loader)
    assert [b["cu_seq_lens_q"].tolist() for b in batches] == [[0, 3, 8], [0, 2, 6]]
    assert batches[1]["labels"].tolist() == [[-100, 2, -100, 2, 3, 4]]


def test_batch_pickles_keep_shared_structure_and_metadata():
    import pickle

    c = padless.Collator({"input_ids": padless.Field(ragged=0, position_ids="pos", labels="labels")})
    b = c(_features())
    r = pickle.loads(pickle.dumps(b))
    assert r.labels._meta is r.input_ids._meta and r.pos._meta is r.input_ids._meta
    assert r.field_meta("input_ids").outputs == {"position_ids": "pos", "labels": "labels"}
    for k, v in b.hf_kwargs("input_ids").items():
        w = r.hf_kwargs("input_ids")[k]
        assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
