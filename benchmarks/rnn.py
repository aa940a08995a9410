"""An LSTM on variable-length batches: padless vs pack_padded_sequence vs the padded batch.

    python benchmarks/rnn.py [--batches 3] [--rounds 5] [--threads 1] [--device cpu|cuda]
                             [--b 32] [--e 128] [--h 128] [--layers 2] [--clock wall|cpu]

``nn.LSTM(E, H, num_layers=2, bidirectional=True, batch_first=True)``, forward + backward
(the loss reads every output and the final states; the input requires a gradient, as the
output of an embedding does). Lengths are lognormal, clamped to [8, 256]. Three ways to run
the same module on the same batch:

* **padless**: the module on the NestedTensor ``(B, L_i, E)`` straight from the collate
  (packed rows gathered into ``PackedSequence`` order and back, planned from host metadata;
  on the CPU, with a gradient recorded, padless's own recurrence instead of torch's packed
  kernel, whose backward zero-fills a ``(sum L_i, 4H)`` buffer per time step: see
  ``padless/ops/recurrent/loop.py``);
* **pack_padded**: how RNN pipelines run today: the padded batch ``(B, L_max, E)`` and its
  lengths through ``pack_padded_sequence(enforce_sorted=False)``, the module, and
  ``pad_packed_sequence``;
* **padded**: the module on the padded batch, no packing (the padded steps run, and the
  reverse direction and the final states read them: not the per-sample result).

Every batch runs the three round-robin (``padless.testing.bench.interleaved``), the table
gives medians of per-batch times and of per-round ratios against ``pack_padded``. Before
timing, the padless output is checked against ``pack_padded``'s on the first batch. The
machine this runs on is usually shared and noisy: read the ratios, not the microseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence

import padless
from padless.testing import bench


def lengths(b: int, g: torch.Generator) -> list[int]:
    return torch.empty(b).log_normal_(mean=4.0, std=0.9, generator=g).clamp(8, 256).round().long().tolist()


def steps(lstm: nn.LSTM, xs: list[torch.Tensor], device: str) -> dict:
    """The three fwd+bwd steps on one batch (inputs built once, outside the timing)."""
    lens = torch.tensor([x.shape[0] for x in xs])
    nt = padless.from_list([x.to(device) for x in xs], requires_grad=True)
    padded = pad_sequence(xs, batch_first=True).to(device).requires_grad_()
    mask = (torch.arange(padded.shape[1]) < lens[:, None]).to(device).unsqueeze(-1)

    def run_padless():
        out, (h, c) = lstm(nt)
        (out.values().sum() + h.sum() + c.sum()).backward()

    def run_pack_padded():
        packed = pack_padded_sequence(padded, lens, batch_first=True, enforce_sorted=False)
        out, (h, c) = lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True)
        (out.sum() + h.sum() + c.sum()).backward()

    def run_padded():
        out, (h, c) = lstm(padded)
        ((out * mask).sum() + h.sum() + c.sum()).backward()

    return {"pack_padded": run_pack_padded, "padless": run_padless, "padded": run_padded}, nt, padded, lens


def check(lstm: nn.LSTM, nt, padded, lens) -> None:
    with torch.no_grad():
        out, (h, _) = lstm(nt)
        ref, (h_ref, _) = lstm(pack_padded_sequence(padded, lens, batch_first=True, enforce_sorted=False))
        ref, _ = pad_packed_sequence(ref, batch_first=True)
    tol = 1e-4 if nt.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.to_padded(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(h, h_ref, atol=tol, rtol=tol)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--b", type=int, default=32)
    p.add_argument("--e", type=int, default=128)
    p.add_argument("--h", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    lstm = nn.LSTM(a.e, a.h, num_layers=a.layers, bidirectional=True, batch_first=True).to(a.device)
    g = torch.Generator().manual_seed(1)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    per_batch: dict[str, list[tuple[float, float]]] = {}
    occ = []
    for i in range(a.batches):
        lens = lengths(a.b, g)
        occ.append(sum(lens) / (a.b * max(lens)))
        xs = [torch.randn(n, a.e, generator=g) for n in lens]
        impls, nt, padded, lt = steps(lstm, xs, a.device)
        if i == 0:
            check(lstm, nt, padded, lt)
        res = bench.interleaved(impls, baseline="pack_padded", rounds=a.rounds, warmup=1, device=a.device, clock=clock)
        for k, v in res.items():
            per_batch.setdefault(k, []).append(v)
    rows = [
        bench.Row(f"B={a.b} occ={statistics.mean(occ):.2f}", k, statistics.median(t for t, _ in v), statistics.median(r for _, r in v))
        for k, v in per_batch.items()
    ]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    title = (
        f"LSTM fwd+bwd, {a.layers} layers bidirectional, E={a.e} H={a.h}, lognormal lengths 8..256, "
        f"{a.batches} batches x {a.rounds} rounds, {a.device}, {a.threads} thread(s), load {load:.1f}"
    )
    bench.print_table(rows, title, "pack_padded")


if __name__ == "__main__":
    main()
