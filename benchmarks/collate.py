"""collate_fn throughput: padless against the padded path, through a real DataLoader, in one run.

    python benchmarks/collate.py [--batches 8] [--rounds 5] [--workers 0,2] [--threads 1]
                                 [--kinds tokens,images,images_chw,pairs]

Batch kinds (``padless.collation.synthetic``):

* tokens: B=64 sequences, lengths lognormal(5, 1) clipped to [1, 2048] (int64 ids);
* images: B=32 uint8 images (3, H, W), H and W uniform in [64, 512], as the readers return
  them: channels-last views of the decoder's (H, W, 3) buffer;
* images_chw: the same images as contiguous (3, H, W) tensors (a user dataset's layout);
* pairs:  B=8 samples with single features (N, 32) and a pair state (N, N, 16),
  N uniform in [24, 256], with pair maps (``Field(pair=True)``).

The collate-call table also times dict samples with five fields (``input_ids``,
``attention_mask``, ``labels``, an int, a string) against ``pad_sequence`` per field plus a
mask. ``--threads`` sets the main process's torch threads (1: as in a worker; DataLoader
workers always run one).

The padded path is what such a project writes by hand: ``pad_sequence`` or
zero-filled padding plus boolean masks (``default_collate`` for the labels). The
padless path is ``padless.Collator``. Both go through the same ``DataLoader``
(``pin_memory=True`` when the machine can pin; "pinning unavailable" otherwise),
rounds interleaved (padded epoch, padless epoch, ...); the tables report medians
over rounds, and ratios as medians of per-round ratios.

Reported per kind and worker count: samples/s, main-process CPU time per batch
(``time.process_time`` of the main process: unpickling, pinning, moving), and the
bytes a batch moves to the device (``Batch.nbytes()`` / the padded tensors).
A second table times the collate call itself against ``pad_sequence`` on the same
samples, with the shared interleaved runner.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from typing import Any, Callable

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, default_collate

import padless
from padless.collation.synthetic import ImageDataset, PairDataset, TokenDataset
from padless.testing import bench

BATCH = {"tokens": 64, "images": 32, "images_chw": 32, "pairs": 8}
TOKEN_EPOCHS = 8  # token epochs have 8x the batches of the others (--batches): a token batch takes ~1 ms


# ---------------------------------------------------------------------------- the padded path


def pad_tokens(samples: list[dict]) -> dict:
    ids = [s["input_ids"] for s in samples]
    lengths = torch.tensor([len(t) for t in ids])
    padded = pad_sequence(ids, batch_first=True)
    mask = torch.arange(padded.shape[1])[None, :] < lengths[:, None]
    return {"input_ids": padded, "mask": mask, "label": default_collate([s["label"] for s in samples])}


def pad_images(samples: list[dict]) -> dict:
    imgs = [s["image"] for s in samples]
    h = max(t.shape[1] for t in imgs)
    w = max(t.shape[2] for t in imgs)
    out = torch.zeros(len(imgs), imgs[0].shape[0], h, w, dtype=imgs[0].dtype)
    mask = torch.zeros(len(imgs), h, w, dtype=torch.bool)
    for i, t in enumerate(imgs):
        out[i, :, : t.shape[1], : t.shape[2]] = t
        mask[i, : t.shape[1], : t.shape[2]] = True
    return {"image": out, "mask": mask, "label": default_collate([s["label"] for s in samples])}


def pad_pairs(samples: list[dict]) -> dict:
    singles = [s["single"] for s in samples]
    pairs = [s["pair"] for s in samples]
    n = max(t.shape[0] for t in singles)
    single = pad_sequence(singles, batch_first=True)
    pair = torch.zeros(len(pairs), n, n, pairs[0].shape[-1])
    lengths = torch.tensor([t.shape[0] for t in singles])
    smask = torch.arange(n)[None, :] < lengths[:, None]
    for i, t in enumerate(pairs):
        pair[i, : t.shape[0], : t.shape[1]] = t
    pmask = smask[:, :, None] & smask[:, None, :]
    return {"single": single, "pair": pair, "mask": smask, "pair_mask": pmask,
            "label": default_collate([s["label"] for s in samples])}


def pad_fields(samples: list[dict]) -> dict:
    """Dict samples with several token fields: pad_sequence per field, one mask, the rest as
    default_collate makes it."""
    out = {k: pad_sequence([s[k] for s in samples], batch_first=True) for k in TOKEN_FIELDS}
    lengths = torch.tensor([s["input_ids"].shape[0] for s in samples])
    out["mask"] = torch.arange(out["input_ids"].shape[1])[None, :] < lengths[:, None]
    rest = default_collate([{k: v for k, v in s.items() if k not in TOKEN_FIELDS} for s in samples])
    return {**out, **rest}


TOKEN_FIELDS = ("input_ids", "attention_mask", "labels")
IMAGES = padless.Collator({"image": padless.Field(ragged=(1, 2))})
PADDED: dict[str, Callable] = {"tokens": pad_tokens, "images": pad_images, "images_chw": pad_images, "pairs": pad_pairs}
PADLESS: dict[str, Callable] = {
    "tokens": padless.Collator({"input_ids": padless.Field(ragged=0)}),
    "images": IMAGES,
    "images_chw": IMAGES,
    "pairs": padless.Collator({"single": padless.Field(ragged=0, pair=True), "pair": padless.Field(ragged=(0, 1))}),
}


def dataset(kind: str, n: int):
    if kind == "tokens":
        return TokenDataset(n, lo=1, hi=2048, mean=5.0, std=1.0)
    if kind in ("images", "images_chw"):
        return ImageDataset(n, lo=64, hi=512, channels_last=kind == "images")
    return PairDataset(n, lo=24, hi=256, c=32, cp=16)


def field_samples() -> list[dict]:
    """The token batch as tokenizer-style dict samples with five fields."""
    ds = dataset("tokens", BATCH["tokens"])
    out = []
    for i in range(BATCH["tokens"]):
        ids = ds[i]["input_ids"]
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
                    "length": int(ids.shape[0]), "id": f"doc{i}"})
    return out


# ---------------------------------------------------------------------------- measuring


def can_pin() -> bool:
    try:
        torch.empty(1).pin_memory()
        return True
    except RuntimeError:
        return False


def bytes_of(batch: Any) -> int:
    if isinstance(batch, padless.Batch):
        return batch.nbytes()
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


def move(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, padless.Batch):
        return batch.to(device, non_blocking=True)
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def epoch(loader: DataLoader, device: torch.device) -> tuple[float, float, int]:
    """(wall seconds, main-process CPU seconds, bytes of the first batch) for one pass."""
    nbytes = 0
    c0, t0 = time.process_time(), time.perf_counter()
    for i, b in enumerate(loader):
        b = move(b, device)
        if i == 0:
            nbytes = bytes_of(b)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0, nbytes


def loader_rows(kinds: list[str], workers: list[int], epoch_batches: int, rounds: int, pin: bool) -> list[dict]:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for kind in kinds:
        b = BATCH[kind]
        batches = epoch_batches * TOKEN_EPOCHS if kind == "tokens" else epoch_batches  # ~1 ms batches: more of them
        ds = dataset(kind, b * batches)
        for w in workers:
            loaders = {
                name: DataLoader(ds, batch_size=b, num_workers=w, collate_fn=fn, pin_memory=pin,
                                 persistent_workers=w > 0)
                for name, fn in (("padded", PADDED[kind]), ("padless", PADLESS[kind]))
            }
            for ld in loaders.values():
                epoch(ld, device)  # warm-up: worker start, first-touch of memory
            res: dict[str, list[tuple[float, float, int]]] = {"padded": [], "padless": []}
            for _ in range(rounds):
                for name, ld in loaders.items():
                    res[name].append(epoch(ld, device))
            n = b * batches
            ratios = [pad[0] / nt[0] for pad, nt in zip(res["padded"], res["padless"])]
            row = {"kind": kind, "workers": w, "speedup": statistics.median(ratios)}
            for name, r in res.items():
                row[name + "_sps"] = n / statistics.median(x[0] for x in r)
                row[name + "_main_ms"] = 1e3 * statistics.median(x[1] for x in r) / batches
                row[name + "_mb"] = r[0][2] / 1e6
            rows.append(row)
            del loaders
    return rows


def collate_call_rows(kinds: list[str], rounds: int) -> list[bench.Row]:
    """The collate call itself, on the same samples, interleaved with the padded collate_fn."""
    out: list[bench.Row] = []
    notes = {"pad_sequence": "alone, no mask", "padless.collate(tensors)": "the bare tensors, no dicts"}
    for kind in kinds:
        ds = dataset(kind, BATCH[kind])
        samples = [ds[i] for i in range(BATCH[kind])]
        if kind == "tokens":
            seqs = [s["input_ids"] for s in samples]
        elif kind == "pairs":
            seqs = [s["single"] for s in samples]
        else:
            seqs = [s["image"].flatten(1).t() for s in samples]  # (H*W, 3) rows: what pad_sequence can pad
        impls = {
            "padded collate_fn": lambda: PADDED[kind](samples),
            "padless.collate": lambda: padless.collate(samples),
            "padless Collator": lambda: PADLESS[kind](samples),
            "pad_sequence": lambda: pad_sequence(seqs, batch_first=True),
            "padless.collate(tensors)": lambda: padless.collate(seqs),
        }
        res = bench.interleaved(impls, baseline="padded collate_fn", rounds=max(20, rounds * 10), warmup=2)
        out += bench.rows_from(kind, res, notes)
    if "tokens" in kinds:
        dicts = field_samples()
        fields = padless.Collator({k: padless.Field(ragged=0) for k in TOKEN_FIELDS})
        impls = {
            "padded collate_fn": lambda: pad_fields(dicts),
            "padless.collate": lambda: padless.collate(dicts),
            "padless Collator": lambda: fields(dicts),
        }
        res = bench.interleaved(impls, baseline="padded collate_fn", rounds=max(20, rounds * 10), warmup=2)
        out += bench.rows_from("tokens, 5-field dicts", res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=8, help="batches per epoch")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved epochs per implementation")
    ap.add_argument("--workers", default="0,2")
    ap.add_argument("--kinds", default="tokens,images,images_chw,pairs")
    ap.add_argument("--threads", type=int, default=1, help="main-process torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kinds = [k for k in args.kinds.split(",") if k]
    workers = [int(w) for w in args.workers.split(",") if w]
    pin = can_pin()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load()}, pin_memory: "
          f"{'on' if pin else 'pinning unavailable (no accelerator): loaders run with pin_memory=False'}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = loader_rows(kinds, workers, args.batches, args.rounds, pin)
    print("\n### DataLoader throughput (samples/s, higher is better)\n")
    print("| kind | workers | padded samples/s | padless samples/s | padless speed-up | main ms/batch padded | "
          "main ms/batch padless | MB moved padded | MB moved padless |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kind']} | {r['workers']} | {r['padded_sps']:,.0f} | {r['padless_sps']:,.0f} | "
              f"{r['speedup']:.2f}x | {r['padded_main_ms']:.2f} | {r['padless_main_ms']:.2f} | "
              f"{r['padded_mb']:.2f} | {r['padless_mb']:.2f} |")
    bench.print_table(collate_call_rows(kinds, args.rounds), "The collate call itself", "padded collate_fn")
    print(f"\nload average at the end: {load()}")


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
