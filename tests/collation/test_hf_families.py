"""``model(inputs_embeds=nt)`` across transformers families, nothing else passed (skipped
without transformers; run with ``zoo/.venv/bin/python -m pytest``).

Tiny random decoders (GPT-2, OPT, GPT-NeoX, Qwen2/3, Mistral, Gemma, Phi-3) and encoders
(RoBERTa, DistilBERT, ELECTRA) with eager and sdpa attention: each sample's output equals
the model on that sample alone; for GPT-2 and RoBERTa the gradients of one loss too.
GPT-2's ``Conv1D`` and OPT's MLP flatten the batch to rows and view back to the shape
they read (padless.ops.rows.packed_rows).
"""

from __future__ import annotations

import pytest
import torch

import padless

transformers = pytest.importorskip("transformers")

H = 32
LENGTHS = [5, 9, 1]


def _common() -> dict:
    return dict(vocab_size=100, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=128)


def _families() -> dict:
    t, c = transformers, _common
    no_drop = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return {
        "gpt2": lambda a: t.GPT2Model(t.GPT2Config(vocab_size=100, n_embd=H, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0,
                                                   embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=a)),
        "opt": lambda a: t.OPTModel(t.OPTConfig(vocab_size=100, hidden_size=H, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                                max_position_embeddings=128, word_embed_proj_dim=H, dropout=0.0, attention_dropout=0.0,
                                                attn_implementation=a)),
        "gpt_neox": lambda a: t.GPTNeoXModel(t.GPTNeoXConfig(**c(), hidden_dropout=0.0, attention_dropout=0.0, attn_implementation=a)),
        "qwen2": lambda a: t.Qwen2Model(t.Qwen2Config(**c(), num_key_value_heads=2, attn_implementation=a)),
        "qwen3": lambda a: t.Qwen3Model(t.Qwen3Config(**c(), num_key_value_heads=2, head_dim=8, attn_implementation=a)),
        "mistral": lambda a: t.MistralModel(t.MistralConfig(**c(), num_key_value_heads=2, attn_implementation=a)),
        "gemma": lambda a: t.GemmaModel(t.GemmaConfig(**c(), num_key_value_heads=2, head_dim=8, attn_implementation=a)),
        "phi3": lambda a: t.Phi3Model(t.Phi3Config(**c(), num_key_value_heads=2, pad_token_id=0, attn_implementation=a)),
        "roberta": lambda a: t.RobertaModel(t.RobertaConfig(**c(), **no_drop, attn_implementation=a)),
        "distilbert": lambda a: t.DistilBertModel(t.DistilBertConfig(vocab_size=100, dim=H, n_layers=2, n_heads=4, hidden_dim=64,
                                                                     dropout=0.0, attention_dropout=0.0, attn_implementation=a)),
        "electra": lambda a: t.ElectraModel(t.ElectraConfig(**c(), embedding_size=H, **no_drop, attn_implementation=a)),
    }


FAMILIES = ["gpt2", "opt", "gpt_neox", "qwen2", "qwen3", "mistral", "gemma", "phi3", "roberta", "distilbert", "electra"]


def _build(name: str, attn: str) -> torch.nn.Module:
    try:
        mk = _families()[name]
        torch.manual_seed(0)
        return mk(attn)
    except (AttributeError, ImportError, TypeError) as e:  # a family this transformers version lacks
        pytest.skip(f"{name}: {e}")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", FAMILIES)
def test_inputs_embeds_per_sample(name, attn):
    model = _build(name, attn).eval()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, H, generator=g) for n in LENGTHS]
    with torch.no_grad():
        out = model(inputs_embeds=padless.from_list(xs)).last_hidden_state
        assert isinstance(out, padless.NestedTensor)
        for got, x in zip(out.unbind(), xs):
            torch.testing.assert_close(got, model(inputs_embeds=x[None]).last_hidden_state[0], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "roberta"])
def test_inputs_embeds_gradients(name):
    model = _build(name, "sdpa").train()
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, H, generator=g) for n in LENGTHS]
    nt = padless.from_list([x.clone() for x in xs]).requires_grad_()
    (model(inputs_embeds=nt).last_hidden_state.values() ** 2).sum().backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    leaves = [x.clone().requires_grad_() for x in xs]
    sum((model(inputs_embeds=x[None]).last_hidden_state ** 2).sum() for x in leaves).backward()
    for k, p in model.named_parameters():
        if k in got:
            torch.testing.assert_close(got[k], p.grad, atol=2e-5, rtol=1e-4)
    for gx, x in zip(nt.grad.unbind(), leaves):
        torch.testing.assert_close(gx, x.grad, atol=2e-5, rtol=1e-4)
