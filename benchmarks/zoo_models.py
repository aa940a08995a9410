"""The zoo's models, batches, padded baselines and named edits (``benchmarks/zoo.py`` runs them).

Each ``Case`` says how to build one model of a real package (random init, no download),
draw a batch of samples, run it on padless input (outputs per sample), run it on one sample
alone, and compute the padded baseline's training loss. ``per_sample_diff`` and
``grad_diff`` are the checks; ``tests/zoo/test_zoo_models.py`` reuses all of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

import padless


# ----------------------------------------------------------------------------- edits

@dataclasses.dataclass(frozen=True)
class Edit:
    """A named, minimal change to a model or its package, applied only when a row needs it."""

    name: str
    why: str
    apply: Callable[[nn.Module], Callable[[], None]]  # applies the change to (the package of) a model; returns the undo


def _patch(obj: Any, attr: str, new: Any) -> Callable[[], None]:
    old = getattr(obj, attr)
    setattr(obj, attr, new)
    return lambda: setattr(obj, attr, old)


def _boltz_no_chunk(model: nn.Module) -> Callable[[], None]:
    from boltz.model.layers.triangular_attention import attention as tri

    orig = tri.TriangleAttention.forward

    def forward(self, x, mask=None, chunk_size=None, use_kernels=False):
        return orig(self, x, mask=mask, chunk_size=None, use_kernels=use_kernels)

    return _patch(tri.TriangleAttention, "forward", forward)


EDITS = {
    "boltz-no-chunk": Edit(
        "boltz-no-chunk",
        "in eval mode PairformerModule chunks triangle attention (chunk size 128 or 512); boltz's "
        "`chunk_layer` measures its inputs with `_fetch_dims`, which accepts only `type(t) is torch.Tensor` "
        "and raises `ValueError: Not supported` for any subclass, a NestedTensor included (boltz's own check); "
        "the edit calls `TriangleAttention` with `chunk_size=None`, as training mode does",
        _boltz_no_chunk,
    ),
}


@contextlib.contextmanager
def edits_applied(names: tuple[str, ...], model: nn.Module) -> Iterator[None]:
    undo = [EDITS[n].apply(model) for n in names]
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


# ----------------------------------------------------------------------------- batches

def _rng(seed: int) -> random.Random:
    return random.Random(seed)


def image_samples(seed: int, b: int = 6, lo: int = 48, hi: int = 128, multiple: int = 1) -> list[torch.Tensor]:
    """``b`` images (3, H_i, W_i), sides uniform over the multiples of ``multiple`` in [lo, hi]."""
    r = _rng(seed)
    g = torch.Generator().manual_seed(seed)
    sides = list(range(-(-lo // multiple) * multiple, hi + 1, multiple))
    return [torch.randn(3, r.choice(sides), r.choice(sides), generator=g) for _ in range(b)]


def token_samples(seed: int, b: int = 6, lo: int = 16, hi: int = 128, dim: int = 128) -> list[torch.Tensor]:
    r = _rng(seed)
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(r.randint(lo, hi), dim, generator=g) for _ in range(b)]


def pair_samples(seed: int, b: int = 4, lo: int = 16, hi: int = 48, cs: int = 32, cz: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    r = _rng(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(b):
        n = r.randint(lo, hi)
        out.append((torch.randn(n, cs, generator=g), torch.randn(n, n, cz, generator=g)))
    return out


def id_samples(seed: int, b: int = 8, keys: tuple[str, ...] = ("f0", "f1"), hi: int = 64, rows: int = 1000) -> list[dict[str, torch.Tensor]]:
    """Per sample, a list of ids per key; lengths lognormal-ish in [0, hi]."""
    r = _rng(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(b):
        out.append({k: torch.randint(0, rows, (min(hi, int(r.lognormvariate(2.5, 0.8))),), generator=g) for k in keys})
    return out


def pad_images(imgs: list[torch.Tensor]) -> torch.Tensor:
    h = max(i.shape[1] for i in imgs)
    w = max(i.shape[2] for i in imgs)
    return torch.stack([F.pad(i, (0, w - i.shape[2], 0, h - i.shape[1])) for i in imgs])


def pad_seq(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(x.shape[0] for x in xs)
    dense = torch.stack([F.pad(x, (0,) * 2 * (x.dim() - 1) + (0, n - x.shape[0])) for x in xs])
    mask = torch.stack([torch.arange(n) < x.shape[0] for x in xs])
    return dense, mask


def pad_pairs(zs: list[torch.Tensor]) -> torch.Tensor:
    n = max(z.shape[0] for z in zs)
    return torch.stack([F.pad(z, (0, 0, 0, n - z.shape[1], 0, n - z.shape[0])) for z in zs])


def occupancy(shapes: list[tuple[int, ...]]) -> float:
    env = [max(s[d] for s in shapes) for d in range(len(shapes[0]))]
    return sum(math.prod(s) for s in shapes) / (len(shapes) * math.prod(env))


# ----------------------------------------------------------------------------- builders

def no_zero_weights(model: nn.Module, std: float = 0.05) -> nn.Module:
    """Fill every all-zero parameter with small random values (applied to every zoo model).

    boltz initialises the last projection of every residual branch to zero (``final_init_``)
    and timm the last BatchNorm scale of every residual block (``zero_init_last``), so a fresh
    model skips its residual branches and a per-sample check would compare little of it.
    """
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def build_timm(name: str) -> nn.Module:
    import timm

    torch.manual_seed(0)
    return no_zero_weights(timm.create_model(name, pretrained=False, num_classes=10))


def build_smp(arch: str) -> nn.Module:
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    return no_zero_weights(getattr(smp, arch)(encoder_name="resnet18", encoder_weights=None, classes=3))


TOKEN_S, TOKEN_Z = 32, 16


def build_pairformer(kind: str) -> nn.Module:
    from boltz.model.layers.pairformer import PairformerLayer, PairformerModule

    torch.manual_seed(0)
    kw = dict(num_heads=4, dropout=0.0, pairwise_head_width=8, pairwise_num_heads=2)
    if kind == "layer":
        return no_zero_weights(PairformerLayer(TOKEN_S, TOKEN_Z, v2=True, **kw))
    return no_zero_weights(PairformerModule(TOKEN_S, TOKEN_Z, num_blocks=2, v2=True, **kw))


HIDDEN = 128


def build_hf(kind: str) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=4 * HIDDEN,
                  vocab_size=1000, max_position_embeddings=256)
    if kind == "bert":
        cfg = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)
        model = transformers.BertModel(cfg, add_pooling_layer=False)
    else:
        cfg = transformers.LlamaConfig(num_key_value_heads=4, **common)
        model = transformers.LlamaModel(cfg)
    model.config._attn_implementation = "sdpa"
    return no_zero_weights(model)


EMB_DIM, EMB_ROWS = 32, 1000


def build_torchrec(kind: str, keys: tuple[str, ...] = ("f0", "f1")) -> nn.Module:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    torch.manual_seed(0)
    if kind == "ebc":
        tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=EMB_DIM, num_embeddings=EMB_ROWS, feature_names=[k]) for k in keys]
        return no_zero_weights(EmbeddingBagCollection(tables=tables))
    tables = [EmbeddingConfig(name=f"t_{k}", embedding_dim=EMB_DIM, num_embeddings=EMB_ROWS, feature_names=[k]) for k in keys]
    return no_zero_weights(EmbeddingCollection(tables=tables))


def padless_kjt(samples: list[dict[str, torch.Tensor]]) -> padless.KeyedJaggedTensor:
    keys = list(samples[0])
    values = torch.cat([s[k] for k in keys for s in samples])
    lengths = torch.tensor([len(s[k]) for k in keys for s in samples])
    return padless.KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


# ----------------------------------------------------------------------------- cases

@dataclasses.dataclass
class Case:
    """One zoo row: how to build the model, feed it and compare it."""

    name: str
    family: str
    what: str  # the input, in words
    build: Callable[[], nn.Module]
    samples: Callable[[int], list]
    shapes: Callable[[list], list[tuple[int, ...]]]  # per-sample element shapes for the occupancy
    batched: Callable[[nn.Module, list], list[torch.Tensor]]  # padless path, per-sample outputs
    single: Callable[[nn.Module, Any], torch.Tensor]  # the model on one sample alone
    padded_loss: Callable[[nn.Module, list], torch.Tensor]  # the padded baseline's train loss
    padless_loss: Callable[[nn.Module, list], torch.Tensor] | None = None  # default: sum of per-sample output means
    grad: bool = False  # check gradients (one model per family)
    edits: tuple[str, ...] = ()  # named edits to try when the unchanged model raises
    train_edits: bool = True  # whether the edits also apply to the train step


def _sq_mean(t: torch.Tensor) -> torch.Tensor:
    return t.float().pow(2).mean()


def _unbind(out: Any) -> list[torch.Tensor]:
    if isinstance(out, padless.NestedTensor):
        return list(out.unbind())
    return list(out.unbind(0))


# images ----------------------------------------------------------------------

def _img_batched(model, imgs):
    return _unbind(model(padless.from_list(imgs, ragged_dims=(1, 2))))


def _img_single(model, img):
    return model(img[None])[0]


def _img_padded_loss(model, imgs):
    out = model(pad_images(imgs))
    if out.dim() == 2:  # classifier logits: one row per image
        return out.pow(2).mean(-1).sum()
    # dense prediction: the mean over each image's own pixels
    masks = pad_images([torch.ones(1, *i.shape[1:]) for i in imgs])
    return sum(((out[j] * masks[j]).pow(2).sum() / (masks[j].sum() * out.shape[1])) for j in range(len(imgs)))


def image_cases() -> list[Case]:
    shapes = lambda imgs: [tuple(i.shape) for i in imgs]  # noqa: E731
    out = []
    for name, grad in (("resnet18", True), ("resnet50", False)):
        out.append(Case(f"timm {name}", "timm", "images 3x[48..128]^2, B 6", lambda n=name: build_timm(n),
                        lambda s: image_samples(s, 6, 48, 128), shapes, _img_batched, _img_single, _img_padded_loss,
                        grad=grad))
    for arch, grad in (("Unet", True), ("FPN", False)):
        out.append(Case(f"smp {arch} (resnet18)", "smp", "images 3x{64,96,128}^2, B 4", lambda a=arch: build_smp(a),
                        lambda s: image_samples(s, 4, 64, 128, multiple=32), shapes, _img_batched, _img_single,
                        _img_padded_loss, grad=grad))
    # Wider size ranges (occupancy ~0.4-0.6): the rows above fill 0.67-0.75 of the padded
    # envelope, so their limit, 1/occupancy, is 1.33-1.49x whatever the layout.
    for name, grad in (("resnet18", True), ("resnet50", False)):
        out.append(Case(f"timm {name} (wide sizes)", "timm", "images 3x[48..216]^2, B 12", lambda n=name: build_timm(n),
                        lambda s: image_samples(s, 12, 48, 216), shapes, _img_batched, _img_single, _img_padded_loss,
                        grad=grad))
    for arch, grad in (("Unet", True), ("FPN", False)):
        out.append(Case(f"smp {arch} (resnet18, wide sizes)", "smp", "images 3x{64,96,..,224}^2, B 8",
                        lambda a=arch: build_smp(a), lambda s: image_samples(s, 8, 64, 224, multiple=32), shapes,
                        _img_batched, _img_single, _img_padded_loss, grad=grad))
    return out


# pairs -----------------------------------------------------------------------

def _pair_args(samples):
    s = padless.from_list([a for a, _ in samples], ragged_dims=(0,))
    z = padless.from_list([b for _, b in samples], ragged_dims=(0, 1))  # ragged even if all N agree
    mask = padless.from_list([torch.ones(a.shape[0]) for a, _ in samples], ragged_dims=(0,))
    pair_mask = padless.from_list([torch.ones(b.shape[:2]) for _, b in samples], ragged_dims=(0, 1))
    return s, z, mask, pair_mask


def _pair_batched(model, samples):
    s, z = model(*_pair_args(samples))
    return [torch.cat([a.reshape(-1), b.reshape(-1)]) for a, b in zip(s.unbind(), z.unbind())]


def _pair_single(model, sample):
    a, b = sample
    n = a.shape[0]
    s, z = model(a[None], b[None], torch.ones(1, n), torch.ones(1, n, n))
    return torch.cat([s[0].reshape(-1), z[0].reshape(-1)])


def _pair_padless_loss(model, samples):
    s, z = model(*_pair_args(samples))
    return sum(_sq_mean(a) + _sq_mean(b) for a, b in zip(s.unbind(), z.unbind()))


def _pair_padded_loss(model, samples):
    s, mask = pad_seq([a for a, _ in samples])
    z = pad_pairs([b for _, b in samples])
    m = mask.float()
    pm = m[:, :, None] * m[:, None, :]
    so, zo = model(s, z, m, pm)
    return sum(_sq_mean(so[j, : a.shape[0]]) + _sq_mean(zo[j, : a.shape[0], : a.shape[0]]) for j, (a, _) in enumerate(samples))


def pair_cases() -> list[Case]:
    shapes = lambda ss: [tuple(b.shape) for _, b in ss]  # noqa: E731
    return [
        Case("boltz PairformerLayer", "boltz", "s (N_i, 32), z (N_i, N_i, 16), N 16..48, B 4",
             lambda: build_pairformer("layer"), lambda s: pair_samples(s), shapes, _pair_batched, _pair_single,
             _pair_padded_loss, _pair_padless_loss, grad=True),
        Case("boltz PairformerModule (2 blocks)", "boltz", "s (N_i, 32), z (N_i, N_i, 16), N 16..48, B 4",
             lambda: build_pairformer("module"), lambda s: pair_samples(s), shapes, _pair_batched, _pair_single,
             _pair_padded_loss, _pair_padless_loss, edits=("boltz-no-chunk",), train_edits=False),
    ]


# tokens: transformers -------------------------------------------------------

def _train(model) -> dict:
    """A decoder's training call: ``use_cache=False`` (a train step reads no cache; with the
    default a ``DynamicCache`` copies every layer's keys and values), for every path of a row:
    padless, the padded baseline and the per-sample reference alike."""
    return {} if _is_bert(model) else {"use_cache": False}


def _hf_embeds_batched(model, xs):
    return _unbind(model(inputs_embeds=padless.from_list(xs), **_train(model)).last_hidden_state)


def _hf_embeds_single(model, x):
    return model(inputs_embeds=x[None], **_train(model)).last_hidden_state[0]


def _hf_embeds_padded_loss(model, xs):
    dense, mask = pad_seq(xs)
    out = model(inputs_embeds=dense, attention_mask=mask.long(), **_train(model)).last_hidden_state
    return sum(_sq_mean(out[j, : x.shape[0]]) for j, x in enumerate(xs))


def id_seqs(seed: int, b: int = 6, lo: int = 16, hi: int = 128) -> list[torch.Tensor]:
    r = _rng(seed)
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 1000, (r.randint(lo, hi),), generator=g) for _ in range(b)]


def _collated(model, ids):
    """The documented packed path: FlatteningCollator's (1, T) row, attention by padless
    (``import padless.hf`` registers ``attn_implementation="padless"``: per-document
    attention from ``cu_seq_lens``, no T x T mask); the padded baseline keeps sdpa."""
    import padless.hf  # noqa: F401

    c = padless.FlatteningCollator(causal=not _is_bert(model))
    batch = c([{"input_ids": i} for i in ids])
    batch.pop("labels", None)
    old = model.config._attn_implementation
    model.config._attn_implementation = "padless"
    try:
        out = model(**batch).last_hidden_state[0]
    finally:
        model.config._attn_implementation = old
    cu = batch["cu_seq_lens_q"].tolist()
    return [out[cu[j]: cu[j + 1]] for j in range(len(ids))]


def _is_bert(model) -> bool:
    return type(model).__name__.startswith("Bert")


def _hf_ids_single(model, ids):
    return model(input_ids=ids[None], **_train(model)).last_hidden_state[0]


def _hf_ids_padded_loss(model, ids):
    dense, mask = pad_seq(ids)
    out = model(input_ids=dense, attention_mask=mask.long(), **_train(model)).last_hidden_state
    return sum(_sq_mean(out[j, : len(i)]) for j, i in enumerate(ids))


def _hf_collated_loss(model, ids):
    return sum(_sq_mean(o) for o in _collated(model, ids))


def token_cases() -> list[Case]:
    emb_shapes = lambda xs: [tuple(x.shape) for x in xs]  # noqa: E731
    id_shapes = lambda ids: [tuple(i.shape) for i in ids]  # noqa: E731
    out = []
    for kind, label in (("bert", "BERT"), ("llama", "Llama")):
        train = ", use_cache=False" if kind == "llama" else ""  # (every path of the row: see _train)
        out.append(Case(f"transformers {label} (inputs_embeds=nt)", "transformers", f"embeds (L_i, 128), L 16..128, B 6{train}",
                        lambda k=kind: build_hf(k), lambda s: token_samples(s), emb_shapes, _hf_embeds_batched,
                        _hf_embeds_single, _hf_embeds_padded_loss, grad=(kind == "bert")))
        out.append(Case(f"transformers {label} (FlatteningCollator, padless attention)", "transformers", f"input_ids L 16..128, B 6, packed (1, T){train}",
                        lambda k=kind: build_hf(k), lambda s: id_seqs(s), id_shapes, _collated, _hf_ids_single,
                        _hf_ids_padded_loss, _hf_collated_loss, grad=(kind == "llama")))
    return out


# sparse: TorchRec ------------------------------------------------------------

def _trec_batched(model, samples):
    res = model(padless_kjt(samples))
    return _trec_rows(res, len(samples))


def _trec_rows(res, b):
    if hasattr(res, "to_dict") and not isinstance(res, dict):  # KeyedTensor: (B, sum dims)
        return list(res.values().unbind(0))
    # EmbeddingCollection: {key: JaggedTensor}; per sample, every key's rows concatenated
    outs = []
    for j in range(b):
        outs.append(torch.cat([jt.to_dense()[j].reshape(-1) for jt in res.values()]))
    return outs


def _trec_single(model, sample):
    return _trec_rows(model(padless_kjt([sample])), 1)[0]


def _trec_padded_loss(model, samples):
    """The padded way: ids (B, L_max) per key with a mask, ``F.embedding`` of the same tables."""
    keys = list(samples[0])
    ebc = type(model).__name__ == "EmbeddingBagCollection"
    tables = model.embedding_bags if ebc else model.embeddings
    loss = 0.0
    for k in keys:
        ids, mask = pad_seq([s[k] for s in samples])
        e = F.embedding(ids, tables[f"t_{k}"].weight) * mask[..., None]
        loss = loss + (_sq_mean(e.sum(1)) if ebc else e.pow(2).sum() / (mask.sum() * EMB_DIM).clamp(min=1))
    return loss


def _trec_padless_loss(model, samples):
    res = model(padless_kjt(samples))
    if isinstance(res, dict):
        return sum(jt.values().pow(2).mean() for jt in res.values())
    return _sq_mean(res.values())


def sparse_cases() -> list[Case]:
    shapes = lambda ss: [(len(s[k]),) for s in ss for k in s]  # noqa: E731
    return [
        Case("torchrec EmbeddingBagCollection", "torchrec", "padless KJT, 2 keys, lengths 0..64, B 32",
             lambda: build_torchrec("ebc"), lambda s: id_samples(s, 32), shapes, _trec_batched, _trec_single,
             _trec_padded_loss, _trec_padless_loss, grad=True),
        Case("torchrec EmbeddingCollection", "torchrec", "padless KJT, 2 keys, lengths 0..64, B 32",
             lambda: build_torchrec("ec"), lambda s: id_samples(s, 32), shapes, _trec_batched, _trec_single,
             _trec_padded_loss, _trec_padless_loss),
    ]


# recurrent: torch's own nn.LSTM ------------------------------------------------

class LSTMTagger(nn.Module):
    """A sequence tagger as RNN pipelines write it: ``lengths`` given, the padded batch goes
    through ``pack_padded_sequence``; a NestedTensor of ids goes in as it is."""

    def __init__(self, vocab: int = 1000, dim: int = HIDDEN, tags: int = 17) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * dim, tags)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(ids)
        if lengths is not None:
            x = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(x)
        if lengths is not None:
            out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return self.head(out)


def _tagger_padded_loss(model, ids):
    dense, mask = pad_seq(ids)
    out = model(dense, mask.sum(1))
    return sum(_sq_mean(out[j, : len(i)]) for j, i in enumerate(ids))


def recurrent_cases() -> list[Case]:
    return [
        Case("torch LSTM tagger (nn.LSTM on nt)", "torch", "input_ids L 16..128, B 6; padded: pack_padded_sequence",
             lambda: (torch.manual_seed(0), LSTMTagger())[1], lambda s: id_seqs(s), lambda ids: [tuple(i.shape) for i in ids],
             lambda model, ids: _unbind(model(padless.from_list(ids))), lambda model, i: model(i[None])[0],
             _tagger_padded_loss, grad=True),
    ]


# sequence-first: torch's own nn.TransformerEncoder, batch_first=False -----------

class SeqFirstEncoder(nn.Module):
    """A tagger written sequence-first, as pre-``batch_first`` code is: ``(T, B, E)`` through
    ``nn.TransformerEncoder(batch_first=False)``, a ``(T, 1, E)`` position table, the padded batch
    with ``src_key_padding_mask``; a NestedTensor of ids goes in as it is (no mask)."""

    def __init__(self, vocab: int = 1000, dim: int = HIDDEN, heads: int = 4, layers: int = 2, tags: int = 17) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(512, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.1)  # batch_first=False
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, tags)

    def forward(self, ids: torch.Tensor, src_key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(ids).transpose(0, 1)  # (T, B, E)
        x = x + self.pos[: x.shape[0]].unsqueeze(1)
        x = self.enc(x, src_key_padding_mask=src_key_padding_mask)
        return self.head(x).transpose(0, 1)


def _seq_first_padded_loss(model, ids):
    dense, mask = pad_seq(ids)
    out = model(dense, src_key_padding_mask=~mask)
    return sum(_sq_mean(out[j, : len(i)]) for j, i in enumerate(ids))


def sequence_first_cases() -> list[Case]:
    return [
        Case("torch TransformerEncoder, sequence-first (T, B, E)", "torch",
             "input_ids L 16..128, B 6; padded: src_key_padding_mask",
             lambda: (torch.manual_seed(0), SeqFirstEncoder())[1], lambda s: id_seqs(s), lambda ids: [tuple(i.shape) for i in ids],
             lambda model, ids: _unbind(model(padless.from_list(ids))), lambda model, i: model(i[None])[0],
             _seq_first_padded_loss, grad=True),
    ]


def all_cases() -> list[Case]:
    return image_cases() + pair_cases() + token_cases() + sparse_cases() + recurrent_cases() + sequence_first_cases()


# ----------------------------------------------------------------------------- checks

def per_sample_diff(case: Case, model: nn.Module, samples: list, scale: list[float] | None = None) -> float:
    """Largest |padless output of sample i - the model on sample i alone|; ``scale`` gets max |alone|."""
    with torch.no_grad():
        got = case.batched(model, samples)
        ref = [case.single(model, s) for s in samples]
    if len(got) != len(ref):
        raise RuntimeError(f"{case.name}: {len(got)} outputs for {len(ref)} samples")
    worst = 0.0
    for j, (a, b) in enumerate(zip(got, ref)):
        a = a.to_padded() if isinstance(a, padless.NestedTensor) else a
        if tuple(a.shape) != tuple(b.shape):
            raise RuntimeError(f"sample {j}: shape {tuple(a.shape)} vs alone {tuple(b.shape)}")
        worst = max(worst, (a.float() - b.float()).abs().max().item() if a.numel() else 0.0)
    if scale is not None:
        scale.append(max((b.abs().max().item() for b in ref if b.numel()), default=0.0))
    return worst


def grad_diff(case: Case, model: nn.Module, samples: list, scale: list[float] | None = None) -> float:
    """Largest |parameter gradient of the padless batch - sum of the per-sample gradients|.

    The loss is the sum over samples of each output's mean square; ``scale`` gets the
    largest |per-sample gradient|.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    default_loss(case)(model, samples).backward()
    got = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    model.zero_grad()
    for s in samples:
        _sq_mean(case.single(model, s)).backward()
    ref = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    model.zero_grad()
    if scale is not None:
        scale.append(max(r.abs().max().item() for r in ref))
    return max((a - b).abs().max().item() for a, b in zip(got, ref))


def default_loss(case: Case) -> Callable[[nn.Module, list], torch.Tensor]:
    def loss(model, samples):
        return sum(_sq_mean(o) for o in case.batched(model, samples))
    return loss
