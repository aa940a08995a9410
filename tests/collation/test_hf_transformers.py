"""padless's Hugging Face path against real transformers models (skipped without transformers).

Tiny randomly initialised models on the CPU: a packed batch from
:class:`padless.FlatteningCollator` gives the tensors of transformers'
``DataCollatorWithFlattening``, and ``model(**batch)`` gives every sample the output it
gets when run alone (the claim in :func:`padless.collation.interop.hf_kwargs`'s docstring).
Run with the separate environment: ``/work/venvs/hf/bin/python -m pytest tests/collation/test_hf_transformers.py``.
"""

from __future__ import annotations

import pytest
import torch

import padless

transformers = pytest.importorskip("transformers")

LENGTHS = [5, 1, 9, 3]


def _features(with_labels: bool = False, empty: bool = False) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    feats = []
    for n in LENGTHS:
        ids = torch.randint(3, 100, (n,), generator=g).tolist()
        f = {"input_ids": ids, "attention_mask": [1] * n}
        if with_labels:
            f["labels"] = [-100] * (n // 2) + ids[n // 2 :]
        feats.append(f)
    if empty:
        feats.insert(2, {"input_ids": [], "attention_mask": [], **({"labels": []} if with_labels else {})})
    return feats


def _llama(attn: str) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attn,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _bert(attn: str) -> torch.nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, attn_implementation=attn,
    )
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()


@pytest.mark.parametrize("with_labels", [False, True])
@pytest.mark.parametrize("empty", [False, True])
def test_same_tensors_as_data_collator_with_flattening(with_labels, empty):
    feats = _features(with_labels, empty)
    ref = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(feats)
    ours = padless.FlatteningCollator(return_seq_idx=True)(feats)
    assert set(ref) <= set(ours) and set(ours) - set(ref) == {"use_cache"}
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            assert ours[k].dtype == v.dtype and ours[k].shape == v.shape, k
            assert torch.equal(ours[k], v), k
        else:
            assert ours[k] == v, k


def test_collator_and_hf_kwargs_match_too():
    feats = _features(with_labels=True)
    ref = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(feats)
    c = padless.Collator({"input_ids": padless.Field(ragged=0, position_ids="position_ids", labels="labels")})
    kw = c(feats).hf_kwargs("input_ids")
    for k, v in ref.items():
        assert torch.equal(kw[k], v) if isinstance(v, torch.Tensor) else kw[k] == v, k


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llama_packed_equals_each_sample_alone(attn):
    model = _llama(attn)
    feats = _features(with_labels=True)
    batch = padless.FlatteningCollator()(feats)
    with torch.no_grad():
        packed = model(**batch).logits[0]
        alone = torch.cat([model(torch.tensor([f["input_ids"]])).logits[0] for f in feats])
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-4)
        # without use_cache=False transformers keeps a cache and lets samples see each other
        leaky = {k: v for k, v in batch.items() if k != "use_cache"}
        assert not torch.allclose(model(**leaky).logits[0], alone, atol=1e-3)


def test_llama_loss_and_gradients_match_the_hf_collator():
    model = _llama("sdpa").train()
    feats = _features(with_labels=True)
    losses, grads = [], []
    ref = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(feats)
    for batch in (padless.FlatteningCollator()(feats), {**ref, "use_cache": False}):
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.model.embed_tokens.weight.grad.clone())
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(grads[0], grads[1])
    # the loss is the mean over the labelled tokens of every sample, each predicted from its own prefix
    with torch.no_grad():
        nll, count = 0.0, 0
        for f in feats:
            logits = model(torch.tensor([f["input_ids"]])).logits[0, :-1]
            target = torch.tensor(f["labels"][1:], dtype=torch.long)
            keep = target != -100
            nll += torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum")
            count += int(keep.sum())
    torch.testing.assert_close(losses[0], nll / count, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bert_needs_the_block_mask_to_keep_samples_apart(attn):
    model = _bert(attn)
    feats = _features()
    with torch.no_grad():
        alone = torch.cat([model(torch.tensor([f["input_ids"]])).last_hidden_state[0] for f in feats])
        ours = padless.FlatteningCollator(causal=False, block_mask=True)(feats)
        inputs = {k: ours[k] for k in ("input_ids", "position_ids", "attention_mask")}
        torch.testing.assert_close(model(**inputs).last_hidden_state[0], alone, atol=1e-5, rtol=1e-4)
        # without the mask: transformers 5.25 splits an encoder's packed row by its position_ids
        # as it does a decoder's (docs/data.md); earlier releases attended across samples
        plain = model(input_ids=ours["input_ids"], position_ids=ours["position_ids"]).last_hidden_state[0]
        splits = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 25)
        assert torch.allclose(plain, alone, atol=1e-3) == splits


def test_llama_block_mask_is_also_exact():
    model = _llama("sdpa")
    feats = _features()
    batch = padless.FlatteningCollator(block_mask=True)(feats)
    with torch.no_grad():
        alone = torch.cat([model(torch.tensor([f["input_ids"]])).logits[0] for f in feats])
        torch.testing.assert_close(model(**batch).logits[0], alone, atol=1e-5, rtol=1e-4)


def test_trainer_takes_it_as_data_collator(tmp_path):
    pytest.importorskip("accelerate")
    model = _llama("sdpa").train()
    feats = _features(with_labels=True) * 2
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[], use_cpu=True,
        remove_unused_columns=False, logging_steps=1, save_strategy="no",
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=feats, data_collator=padless.FlatteningCollator())
    out = trainer.train()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
