"""Swap the collate_fn: an existing DataLoader training loop, converted to padless.

    make demo            (or: python examples/swap_collate.py [--steps 30] [--workers 2])

The "existing" code below pads token sequences with ``pad_sequence`` and carries a
mask through the model. Converting it touches two places, marked ``# padless:``:

1. ``collate_fn=pad_collate``  ->  ``collate_fn=padless.Collator({"input_ids": padless.Field(ragged=0)})``
2. the model's input handling: take ``batch.input_ids`` (a NestedTensor), drop the mask.

The training loop, the optimiser, the loss and the DataLoader stay as they were.
Both versions train from the same initial weights on the same batches; the script
checks that their losses agree, then prints what padding cost.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

import padless

VOCAB = 64


class Sequences(Dataset):
    """Variable-length token sequences; the label says whether most tokens are in the upper half."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        lens = torch.empty(n).log_normal_(mean=3.2, std=0.9, generator=g).round().clamp(4, 256).long().tolist()
        self.items = []
        for n_i in lens:
            bias = float(torch.rand((), generator=g))
            ids = (torch.rand(n_i, generator=g) * VOCAB * (0.5 + bias)).long().clamp(max=VOCAB - 1)
            self.items.append({"input_ids": ids, "label": int((ids >= VOCAB // 2).float().mean() > 0.5)})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def pad_collate(samples: list[dict]) -> dict:
    """The collate_fn the project had: pad to the longest sequence, plus a mask."""
    ids = pad_sequence([s["input_ids"] for s in samples], batch_first=True)
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    return {"input_ids": ids, "mask": mask, "label": torch.tensor([s["label"] for s in samples])}


class Classifier(nn.Module):
    def __init__(self, dim: int = 64, classes: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward_padded(self, batch: dict) -> torch.Tensor:
        """The model's input handling before: padded ids, a mask for the pooling."""
        ids, mask = batch["input_ids"], batch["mask"]
        h = self.emb(ids)
        h = h + self.mlp(h)
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.head(pooled)

    def forward_packed(self, batch: padless.Batch) -> torch.Tensor:
        """padless: the same model on the packed ids; the mean runs over real tokens only."""
        h = self.emb(batch.input_ids)
        h = h + self.mlp(h)
        return self.head(h.mean(dim=1))


def train(loader: DataLoader, model: Classifier, forward, steps: int) -> tuple[list[float], float]:
    """The existing training loop, unchanged for both versions."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses: list[float] = []
    t0 = time.perf_counter()
    while len(losses) < steps:
        for batch in loader:
            batch = batch.to("cpu", non_blocking=True) if isinstance(batch, padless.Batch) else batch
            loss = F.cross_entropy(forward(model, batch), batch["label"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)

    data = Sequences(args.batch * 16)
    model = Classifier()

    def loader(collate_fn):
        g = torch.Generator().manual_seed(1)
        return DataLoader(data, batch_size=args.batch, shuffle=True, generator=g, num_workers=args.workers,
                          collate_fn=collate_fn, persistent_workers=args.workers > 0)

    before = loader(pad_collate)
    after = loader(padless.Collator({"input_ids": padless.Field(ragged=0)}))  # padless: the new collate_fn

    l_pad, t_pad = train(before, copy.deepcopy(model), Classifier.forward_padded, args.steps)
    l_nt, t_nt = train(after, copy.deepcopy(model), Classifier.forward_packed, args.steps)  # padless: new input handling

    diff = max(abs(a - b) for a, b in zip(l_pad, l_nt))
    same = diff < 1e-3
    print(f"losses, padded : {l_pad[0]:.4f} -> {l_pad[-1]:.4f}")
    print(f"losses, padless: {l_nt[0]:.4f} -> {l_nt[-1]:.4f}   max step difference {diff:.1e}: "
          f"{'same training run' if same else 'DIFFERENT'}")

    pb, nb = next(iter(before)), next(iter(after))
    real = nb.input_ids.numel()
    padded_bytes = sum(t.numel() * t.element_size() for t in pb.values())
    print(f"first batch: {real} real tokens in a padded ({pb['input_ids'].shape[0]}, {pb['input_ids'].shape[1]}) "
          f"envelope (occupancy {nb.input_ids.occupancy():.2f})")
    print(f"bytes moved per batch: padded {padded_bytes:,}  padless {nb.nbytes():,}")
    print(f"{args.steps} training steps: padded {t_pad:.2f} s, padless {t_nt:.2f} s ({t_pad / t_nt:.2f}x)")
    if not same:
        raise SystemExit("padless and padded training diverged")


if __name__ == "__main__":
    main()
