"""Host time per training step against the device time of the step: is the step host-bound?

    python benchmarks/host_time.py [--device cuda] [--steps 10]

For three training steps (a pre-LN encoder layer on token batches, a Pairformer layer on pair
states, a ResNet-style CNN on native-size images), padless and padded side by side, it prints:

* ``host ms``: CPU time of the Python thread that issues the step (forward, backward), read
  with ``time.thread_time()``. On a GPU the kernels run asynchronously, so this is the time
  Python needs to launch the step: the fixed cost of every op (dispatch, checks, wrappers,
  autograd nodes) and every plan a new batch builds.
* ``device ms``: the step's time on the device, from CUDA events around it (on the CPU the
  kernels run in the issuing thread, so there is no separate device time: ``-``).
* ``host / device``: above 1 the step is host-bound: the GPU waits for Python, and a faster
  kernel would not make the step faster. Such a step gains from CUDA graphs or
  ``torch.compile`` (fewer launches) before it gains from kernels.

Every step gets a new batch (new lengths), as training does. ``benchmarks/gpu_check.py`` runs
this on the GPU.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import padless  # noqa: E402
from padless.testing.vision import ResNetish  # noqa: E402


def _encoder(device):
    from encoder import PreLNLayer

    torch.manual_seed(0)
    layer = PreLNLayer(128, 4).to(device)

    def batch(rng):
        lens = [rng.randint(16, 256) for _ in range(16)]
        xs = [torch.randn(n, 128) for n in lens]
        nt = padless.from_list(xs, requires_grad=True).to(device)
        pad = torch.nn.utils.rnn.pad_sequence(xs, batch_first=True).to(device).requires_grad_()
        mask = (torch.arange(pad.shape[1])[None] < torch.tensor(lens)[:, None]).to(device)
        return nt, (pad, mask[:, None, None, :])

    def padless_step(nt):
        layer(nt).values().pow(2).mean().backward()

    def padded_step(b):
        pad, mask = b
        out = layer(pad, attn_mask=mask)
        (out.pow(2) * mask[:, 0, 0, :, None]).sum().backward()

    return layer, batch, padless_step, padded_step


def _pairformer(device):
    from pairformer import Batch, MiniPairformer

    torch.manual_seed(0)
    layer = MiniPairformer(64, 64, num_heads=4, dropout=0.0, pairwise_head_width=16, pairwise_num_heads=4).to(device)

    def batch(rng):
        b = Batch([rng.randint(16, 64) for _ in range(8)], 64, 64, seed=rng.randint(0, 10**6)).to(device)
        return b, b

    def padless_step(b):
        s, z = layer(b.ps, b.pz, b.pmask, b.ppair_mask)
        (s.values().pow(2).sum() + z.values().pow(2).sum()).backward()

    def padded_step(b):
        s, z = layer(b.s, b.z, b.mask, b.pair_mask)
        ((s.pow(2) * b.mask[..., None]).sum() + (z.pow(2) * b.pair_mask[..., None]).sum()).backward()

    return layer, batch, padless_step, padded_step


def _resnet(device):
    torch.manual_seed(0)
    net = ResNetish((32, 64, 128)).to(device)

    def batch(rng):
        imgs = [torch.randn(3, rng.randint(48, 128), rng.randint(48, 128)) for _ in range(12)]
        h, w = max(i.shape[1] for i in imgs), max(i.shape[2] for i in imgs)
        pad = torch.stack([F.pad(i, (0, w - i.shape[2], 0, h - i.shape[1])) for i in imgs]).to(device)
        return padless.from_list(imgs).to(device), pad

    def padless_step(x):
        net(x).pow(2).sum().backward()

    def padded_step(x):
        net(x).pow(2).sum().backward()

    return net, batch, padless_step, padded_step


WORKLOADS = {"encoder (d=128, B=16, L 16..256)": _encoder, "Pairformer layer (B=8, N 16..64)": _pairformer,
             "ResNet-style CNN (12 images, 48..128 px)": _resnet}


def _time(step, inp, device) -> tuple[float, float | None]:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
    t0 = time.thread_time()
    step(inp)
    host = time.thread_time() - t0
    if device != "cuda":
        return host * 1e3, None
    end.record()
    torch.cuda.synchronize()
    return host * 1e3, start.elapsed_time(end)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default=None, help="run the workloads whose name contains this")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"host time per training step, {args.device}, torch {torch.__version__}, {args.steps} new batches each, medians")
    print(f"{'workload':44s} {'path':8s} {'host ms':>9s} {'device ms':>10s} {'host/device':>12s}")
    for name, make in WORKLOADS.items():
        if args.only and args.only not in name:
            continue
        _, batch, *steps = make(args.device)
        rng = random.Random(0)
        results: dict[str, list[tuple[float, float | None]]] = {"padless": [], "padded": []}
        for i in range(args.steps + 2):
            nt, pad = batch(rng)
            for path, step, inp in (("padless", steps[0], nt), ("padded", steps[1], pad)):
                r = _time(step, inp, args.device)
                if i >= 2:  # two warm-up steps
                    results[path].append(r)
        for path, rs in results.items():
            host = statistics.median(r[0] for r in rs)
            dev = None if rs[0][1] is None else statistics.median(r[1] for r in rs)
            ratio = "-" if dev is None else f"{host / dev:.2f}" + (" host-bound" if host > dev else "")
            print(f"{name:44s} {path:8s} {host:9.2f} {('-' if dev is None else f'{dev:.2f}'):>10s} {ratio:>12s}")


if __name__ == "__main__":
    main()
