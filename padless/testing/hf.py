"""Tiny random Hugging Face models for the tests of the transformers paths (needs transformers)."""

from __future__ import annotations

import torch


def tiny_model(kind: str, attn: str = "padless", hidden: int = 32) -> torch.nn.Module:
    """A 2-layer, 4-head ``BertModel`` (``kind="bert"``, no dropout) or ``LlamaModel`` (``"llama"``,
    2 key/value heads) of width ``hidden``, seeded, with ``attn_implementation=attn``."""
    import transformers

    common = dict(vocab_size=100, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, attn_implementation=attn)
    torch.manual_seed(0)
    if kind == "bert":
        cfg = transformers.BertConfig(**common, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return transformers.BertModel(cfg)
    return transformers.LlamaModel(transformers.LlamaConfig(**common, num_key_value_heads=2))
