"""Data-parallel training on packed batches: DDP or FSDP2, resumable, same gradients as one process.

    torchrun --nproc-per-node 2 examples/ddp_train.py [--fsdp] [--steps 8] [--ckpt DIR] [--resume]
    python examples/ddp_train.py [--fsdp]        # spawns 2 gloo processes itself (CPU)

What each rank does, and what travels with a batch:

1. ``BudgetBatchSampler(lengths, TokenBudget(...))`` learns ``(rank, world_size)`` from
   ``torch.distributed``; every rank computes the same global list of batches from
   ``(seed, epoch)`` and takes its share, so all ranks run the same number of steps.
2. ``padless.Collator`` packs each batch in a DataLoader worker (offsets, cu_seqlens,
   max_seqlen are computed there and travel with the batch).
3. The model (DDP or FSDP2 ``fully_shard``) runs on packed rows; the loss is summed over
   the rank's real tokens and divided by the real tokens of the whole step, which every
   rank knows locally (``sampler.global_tokens(step)``), so gradients equal the
   single-process gradients on the union of the ranks' batches. Nothing waits on another
   rank except the gradient all-reduce.
4. ``torch.distributed.checkpoint`` saves model, optimizer and sampler state; a resumed
   run continues with exactly the batches the interrupted run would have taken.

Backend: gloo on the CPU, nccl when every rank has a GPU.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader, Dataset

import padless
from padless.distributed import global_mean
from padless.loaders import BudgetBatchSampler, TokenBudget
from padless.loaders.synthetic import token_lengths
from padless.testing.models import TokenMLP

VOCAB = 97


class Sequences(Dataset):
    """Token sequences of lognormal lengths; the target of a token is a fixed function of it."""

    def __init__(self, n: int = 96, seed: int = 0) -> None:
        self.lengths = token_lengths(n, seed=seed, mean=3.0, sigma=0.8, low=1, high=96).tolist()
        g = torch.Generator().manual_seed(seed)
        self.ids = [torch.randint(0, VOCAB, (n_i,), generator=g) for n_i in self.lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        ids = self.ids[i]
        return {"input_ids": ids, "targets": (ids * 7 + 3) % VOCAB}


class TokenModel(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.block = TokenMLP(dim, 2 * dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids):
        return self.head(self.block(self.emb(ids)))


COLLATOR = padless.Collator({"input_ids": padless.Field(ragged=0), "targets": padless.Field(ragged=0)})


def make_loader(data: Dataset, sampler: BudgetBatchSampler, workers: int) -> DataLoader:
    return DataLoader(data, batch_sampler=sampler, collate_fn=COLLATOR, num_workers=workers)


def wrap(model: nn.Module, fsdp: bool) -> nn.Module:
    if not dist.is_initialized():
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model)
    return nn.parallel.DistributedDataParallel(model)


def loss_of(model: nn.Module, batch: padless.Batch, global_tokens: int) -> torch.Tensor:
    logits = model(batch.input_ids)  # (L_i, VOCAB) per sample, packed
    loss_sum = F.cross_entropy(logits, batch.targets, reduction="sum")
    return global_mean(loss_sum, global_tokens)


def save(ckpt: str, model: nn.Module, opt: torch.optim.Optimizer, sampler: BudgetBatchSampler, steps_done: int) -> None:
    msd, osd = get_state_dict(model, opt)
    state = sampler.state_dict(batches_done=steps_done)
    state.pop("rank")  # the same on every rank otherwise; each rank re-learns its own rank
    dcp.save({"model": msd, "optim": osd, "sampler": state}, checkpoint_id=ckpt)


def load(ckpt: str, model: nn.Module, opt: torch.optim.Optimizer, sampler: BudgetBatchSampler) -> int:
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd, "optim": osd, "sampler": sampler.state_dict()}
    state["sampler"].pop("rank")
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sampler.load_state_dict(state["sampler"])
    return int(state["sampler"]["batches_done"])


def train(*, steps: int | None = None, fsdp: bool = False, ckpt: str | None = None, resume: bool = False,
          stop_after: int | None = None, workers: int = 0, seed: int = 0, log: bool = True) -> dict:
    """One epoch (or ``steps``) of training; returns the batches taken, losses and final parameters."""
    torch.manual_seed(seed)
    data = Sequences()
    sampler = BudgetBatchSampler(data.lengths, TokenBudget(160), seed=seed)
    model = wrap(TokenModel(), fsdp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = load(ckpt, model, opt, sampler) if resume else 0
    total = len(sampler) if steps is None else min(steps, len(sampler))
    record: dict[str, Any] = {"batches": [], "losses": [], "steps": len(sampler)}
    step = start
    for batch in make_loader(data, sampler, workers):
        if step >= total:
            break
        opt.zero_grad()
        loss = loss_of(model, batch, sampler.global_tokens(step))
        loss.backward()
        opt.step()
        record["batches"].append(sampler.batches()[step])
        record["losses"].append(float(loss.detach()))
        if log and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"step {step}: {batch.input_ids.values().shape[0]} tokens on this rank, "
                  f"{sampler.global_tokens(step)} in the step, loss share {record['losses'][-1]:.4f}")
        step += 1
        if stop_after is not None and step == stop_after:
            if ckpt is not None:
                save(ckpt, model, opt, sampler, step)
            break
    msd, _ = get_state_dict(model, opt)
    record["params"] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in msd.items()}
    return record


def _spawned(rank: int, world_size: int, init: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        run(args)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    if args.resume or args.stop_after:
        ckpt = args.ckpt or os.path.join(tempfile.gettempdir(), "padless_ddp_ckpt")
    else:
        ckpt = args.ckpt
    rec = train(steps=args.steps, fsdp=args.fsdp, ckpt=ckpt, resume=args.resume, stop_after=args.stop_after,
                workers=args.workers)
    if dist.get_rank() == 0:
        print(f"{'FSDP2' if args.fsdp else 'DDP'}: {len(rec['batches'])} steps on each of {dist.get_world_size()} ranks")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fsdp", action="store_true", help="fully_shard (FSDP2) instead of DDP")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: one epoch)")
    ap.add_argument("--stop-after", type=int, default=None, help="checkpoint and stop after this many steps")
    ap.add_argument("--resume", action="store_true", help="resume from --ckpt")
    ap.add_argument("--ckpt", default=None, help="checkpoint directory (torch.distributed.checkpoint)")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    args = ap.parse_args()
    if "RANK" in os.environ:  # launched by torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
        try:
            run(args)
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:  # no launcher: spawn 2 CPU processes
        torch.multiprocessing.spawn(_spawned, args=(2, f"file://{tmp}/store", args), nprocs=2)


if __name__ == "__main__":
    main()
