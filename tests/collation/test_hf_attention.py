"""``attn_implementation="padless"``: packed rows from FlatteningCollator with no T x T mask
(skipped without transformers). Run with ``zoo/.venv/bin/python -m pytest``.

Tiny random BERT (encoder) and Llama (decoder with GQA): the packed row gives every sample
the output and the gradients it gets alone, with ``cu_seq_lens_*`` or from ``position_ids``
only; a padded batch with an ``attention_mask`` runs as ``"sdpa"``; the mask function never
builds a dense mask for a packed row.
"""

from __future__ import annotations

import pytest
import torch

import padless

transformers = pytest.importorskip("transformers")
from padless.testing.hf import tiny_model  # noqa: E402
import padless.hf  # noqa: E402  (registers attn_implementation="padless")

LENGTHS = [5, 1, 9, 3]


def _model(kind: str, attn: str = "padless") -> torch.nn.Module:
    return tiny_model(kind, attn)


def _ids() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 100, (n,), generator=g) for n in LENGTHS]


@pytest.fixture
def no_dense_mask(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a dense mask was built for a packed row")

    monkeypatch.setattr(padless.hf, "sdpa_mask", refuse)


def test_registered_with_transformers():
    assert "padless" in transformers.AttentionInterface._global_mapping
    assert padless.hf.register() == "padless"
    model = _model("llama")
    assert model.config._attn_implementation == "padless"


@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_packed_row_equals_each_sample_alone(kind, flash_kwargs, no_dense_mask):
    model = _model(kind).train()
    ids = _ids()
    batch = padless.FlatteningCollator(causal=kind == "llama", return_flash_attn_kwargs=flash_kwargs)(
        [{"input_ids": t.tolist()} for t in ids]
    )
    batch.pop("labels")
    y = model(**batch).last_hidden_state[0]
    (y ** 2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    alone = []
    for t in ids:
        yi = model(input_ids=t[None], use_cache=False).last_hidden_state[0]
        (yi ** 2).sum().backward()
        alone.append(yi.detach())
    torch.testing.assert_close(y.detach(), torch.cat(alone), atol=1e-5, rtol=1e-4)
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, atol=1e-4, rtol=1e-4, msg=n)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_padded_batch_with_attention_mask_runs_as_sdpa(kind):
    ids = _ids()
    pad = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)
    mask = (torch.arange(pad.shape[1])[None] < torch.tensor(LENGTHS)[:, None]).long()
    with torch.no_grad():
        ours = _model(kind).eval()(input_ids=pad, attention_mask=mask).last_hidden_state
        ref = _model(kind, "sdpa").eval()(input_ids=pad, attention_mask=mask).last_hidden_state
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(ours[i, :n], ref[i, :n], atol=1e-5, rtol=1e-4)


def test_llama_generation_with_a_cache_runs_as_sdpa():
    ids = _ids()[2][None]
    with torch.no_grad():
        torch.manual_seed(0)
        a = transformers.LlamaForCausalLM(_model("llama").config).eval()
        b = transformers.LlamaForCausalLM(a.config).eval()
        b.load_state_dict(a.state_dict())
        b.set_attn_implementation("sdpa")
        ga = a.generate(ids, max_new_tokens=4, do_sample=False)
        gb = b.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(ga, gb)


def test_cu_seq_lens_that_do_not_cover_the_row_are_refused():
    model = _model("bert").eval()
    batch = padless.FlatteningCollator(causal=False)([{"input_ids": t.tolist()} for t in _ids()])
    batch.pop("labels")
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 5, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q = \[0, 5, 6\] must run from 0 to the packed row's 18 tokens"):
        model(**batch)


def test_position_ids_starting_at_two_still_split_the_row(no_dense_mask):
    # RoBERTa-style positions (FlatteningCollator(position_ids_start=2)) without cu_seq_lens
    model = _model("bert").eval()
    ids = _ids()
    batch = padless.FlatteningCollator(causal=False, position_ids_start=2, return_flash_attn_kwargs=False)(
        [{"input_ids": t.tolist()} for t in ids]
    )
    batch.pop("labels")
    with torch.no_grad():
        packed = model(**batch).last_hidden_state[0]
        alone = [
            model(input_ids=t[None], position_ids=torch.arange(2, 2 + len(t))[None]).last_hidden_state[0] for t in ids
        ]
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-4)
