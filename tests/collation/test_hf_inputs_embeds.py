"""``model(inputs_embeds=nt)`` on real transformers models, nothing else passed (skipped without transformers).

Tiny random BERT (encoder) and Llama (decoder, GQA, rotary) with eager, sdpa and padless
attention: the output is a NestedTensor equal, sample by sample, to the model run on each
sample alone, and a loss summed over the samples gives the parameters and the embeddings
the gradients of the per-sample runs. Position ids and rotary tables the model builds from
``x.shape`` are read in padded coordinates (each sample starts at 0), the masks it builds
from the envelope are read per sample. Run with ``zoo/.venv/bin/python -m pytest``.
"""

from __future__ import annotations

import pytest
import torch

import padless

transformers = pytest.importorskip("transformers")
from padless.testing.hf import tiny_model  # noqa: E402
import padless.hf  # noqa: E402,F401  (registers attn_implementation="padless")

LENGTHS = [5, 1, 9, 3]
D = 32


def _model(kind: str, attn: str) -> torch.nn.Module:
    return tiny_model(kind, attn, hidden=D)


def _samples() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, D, generator=g) for n in LENGTHS]


@pytest.mark.parametrize("attn", ["eager", "sdpa", "padless"])
@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_inputs_embeds_nt_equals_each_sample_alone(kind, attn):
    model = _model(kind, attn).train()
    xs = _samples()
    x = padless.from_list(xs).requires_grad_()
    y = model(inputs_embeds=x, use_cache=False).last_hidden_state
    assert isinstance(y, padless.NestedTensor) and y.shape[0] == len(LENGTHS)
    (y ** 2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    gx = x.grad.unbind()
    model.zero_grad()
    for i, s in enumerate(xs):
        si = s.clone().requires_grad_()
        yi = model(inputs_embeds=si[None], use_cache=False).last_hidden_state[0]
        torch.testing.assert_close(y[i], yi, atol=1e-5, rtol=1e-4)
        (yi ** 2).sum().backward()
        torch.testing.assert_close(gx[i], si.grad, atol=1e-5, rtol=1e-4)
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, atol=1e-4, rtol=1e-4, msg=n)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_inputs_embeds_nt_in_eval_with_the_default_cache(kind):
    # a decoder in eval keeps a cache by default; the output is still per sample
    model = _model(kind, "sdpa").eval()
    xs = _samples()
    with torch.no_grad():
        y = model(inputs_embeds=padless.from_list(xs)).last_hidden_state
        for i, s in enumerate(xs):
            torch.testing.assert_close(y[i], model(inputs_embeds=s[None]).last_hidden_state[0], atol=1e-5, rtol=1e-4)


def test_inputs_embeds_nt_never_builds_a_mask_with_padless_attention(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a dense mask was built")

    monkeypatch.setattr(padless.hf, "sdpa_mask", refuse)
    model = _model("llama", "padless").eval()
    with torch.no_grad():
        y = model(inputs_embeds=padless.from_list(_samples()), use_cache=False).last_hidden_state
    assert isinstance(y, padless.NestedTensor)
