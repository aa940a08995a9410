"""Checks of data-parallel training on packed batches, run in spawned gloo processes.

``tests/test_distributed.py`` spawns :func:`check_rank` on two CPU processes. It loads
``examples/ddp_train.py`` by path (the code a user copies) and writes what each rank saw
to ``outdir/rank{r}.pt`` for the test to compare:

* ``grads``: the DDP (and FSDP2) gradients of a step whose ranks hold different token
  counts, after the all-reduce, next to the gradients of one process on the union of
  both ranks' batches of that step;
* ``steps``: the number of steps each rank takes in an epoch (budget sampler) and from a
  webdataset stream with ``epoch_samples``;
* ``full`` / ``resumed``: batches and final parameters of an uninterrupted run and of a
  run stopped after 2 steps, checkpointed with ``torch.distributed.checkpoint`` and resumed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import torch
import torch.distributed as dist


def load_example(path: str) -> ModuleType:
    """Import ``examples/ddp_train.py`` (not a package module) by its path."""
    name = "padless_examples_ddp_train"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _grads(ex: ModuleType, fsdp: bool) -> dict:
    """Gradients of one step under DDP/FSDP2, and of one process on the union of the step's batches."""
    from padless.loaders import BudgetBatchSampler, TokenBudget

    torch.manual_seed(0)
    data = ex.Sequences()
    sampler = BudgetBatchSampler(data.lengths, TokenBudget(160), seed=0)
    torch.manual_seed(0)
    model = ex.TokenModel()
    torch.manual_seed(0)
    single = ex.TokenModel()  # same initial weights, never wrapped
    wrapped = ex.wrap(model, fsdp)
    # a step whose ranks hold different token counts: there a per-rank mean would be wrong
    tokens = lambda b: sum(data.lengths[i] for i in b)  # noqa: E731
    step = next(s for s in range(len(sampler)) if len({tokens(b) for b in sampler.step_batches(s)}) > 1)
    batch = ex.COLLATOR([data[i] for i in sampler.batches()[step]])
    ex.loss_of(wrapped, batch, sampler.global_tokens(step)).backward()
    union = [i for b in sampler.step_batches(step) for i in b]
    ubatch = ex.COLLATOR([data[i] for i in union])
    logits = single(ubatch.input_ids)
    torch.nn.functional.cross_entropy(logits, ubatch.targets).backward()  # the plain token mean
    got = {}
    for n, p in wrapped.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        got[n.removeprefix("module.")] = g.detach().clone()
    want = {n: p.grad.detach().clone() for n, p in single.named_parameters()}
    return {"got": got, "want": want, "local_tokens": int(batch.input_ids.values().shape[0])}


def _stream_steps(shard_dir: str) -> int:
    """Steps this rank takes over a webdataset epoch of ``epoch_samples`` per rank."""
    import padless
    from padless.loaders import WebDatasetReader

    shards = sorted(os.path.join(shard_dir, f) for f in os.listdir(shard_dir))
    reader = WebDatasetReader(shards, fields={"image": "jpg;png", "label": "cls"}, epoch_samples=10)
    loader = torch.utils.data.DataLoader(reader, batch_size=4, collate_fn=padless.collate)
    return sum(1 for _ in loader)


def check_rank(rank: int, world_size: int, init: str, outdir: str, example: str, shard_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        ex = load_example(example)
        out: dict = {"grads": {"ddp": _grads(ex, fsdp=False)}}
        try:
            out["grads"]["fsdp"] = _grads(ex, fsdp=True)
        except Exception as e:  # recorded, so the test can say why FSDP2 did not run
            out["fsdp_error"] = f"{type(e).__name__}: {e}"
        full = ex.train(steps=4, log=False)
        ckpt = os.path.join(outdir, "ckpt")
        ex.train(steps=4, ckpt=ckpt, stop_after=2, log=False)
        dist.barrier()
        resumed = ex.train(steps=4, ckpt=ckpt, resume=True, log=False)
        out["full"] = {"batches": full["batches"], "params": full["params"], "epoch_steps": full["steps"]}
        out["resumed"] = {"batches": resumed["batches"], "params": resumed["params"]}
        out["stream_steps"] = _stream_steps(shard_dir)
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


__all__ = ["check_rank", "load_example"]
