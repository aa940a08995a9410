"""Kernel checks that need a GPU, in one unattended run (called by ``gpu_check.py``).

    python benchmarks/kernels_gpu.py [--quick] [--smoke]

1. **bandwidth**: every Triton kernel family on large inputs, bytes moved / time
   against the device's peak (grouped matmul in TFLOP/s), kernel vs torch twin;
2. **syncs**: ``torch.cuda.set_sync_debug_mode("error")`` around a full training
   step (forward, backward, optimizer) of the pair block and of the encoder layer;
3. **pair block** (B=8, C=384 single / 128 pair channels, N up to 384, bf16):
   padded + masks vs hand packing vs padless, eager and compiled, with peak memory;
4. **encoder** (BERT-base-like layer: d=768, 12 heads, FFN 3072, bf16, skewed
   lengths): padded + mask vs padless, eager and compiled, with peak memory.

Every section catches its own failure and prints it as a row; the script exits 0.
``--smoke`` runs tiny shapes on the CPU (twins; no timings worth reading): a check
that the script itself works, for machines without a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import padless  # noqa: E402
from padless.ops.kernels import dispatch  # noqa: E402
from padless.testing.kernels import kernels_mode  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


REPS = {"reps": 20, "warmup": 3}  # --smoke: one call each


def bench(fn: Callable[[], object], device: str, reps: int | None = None, warmup: int | None = None) -> float:
    """Median seconds per call."""
    reps = min(reps or REPS["reps"], REPS["reps"])
    warmup = min(REPS["warmup"], warmup if warmup is not None else REPS["warmup"])
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def peak_bandwidth(device: str) -> tuple[float, str]:
    """Peak DRAM bandwidth in bytes/s, and where the figure comes from."""
    if device != "cuda":
        return float("nan"), "no GPU"
    p = torch.cuda.get_device_properties(0)
    clock = getattr(p, "memory_clock_rate", None)  # kHz
    width = getattr(p, "memory_bus_width", None)  # bits
    if clock and width:
        return 2 * clock * 1e3 * width / 8, "2 x memory clock x bus width"
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    t = bench(lambda: x.clone(), device, reps=10)
    return 2 * x.numel() / t, "measured device-to-device copy"


def section(title: str) -> None:
    print(f"\n### {title}\n", flush=True)


def guarded(name: str, fn: Callable[[], None]) -> bool:
    try:
        fn()
        return True
    except Exception as e:  # every section reports its own failure and the run goes on
        print(f"| {name} | FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''} |")
        traceback.print_exc(limit=3, file=sys.stdout)
        return False


# ---------------------------------------------------------------------------- 1. bandwidth


def bandwidth(device: str, dtype: torch.dtype, scale: float) -> None:
    from padless.ops.kernels import layout, pair, segment, softmax
    from padless.ops.common.segment import groups

    section(f"Kernel bandwidth ({device}, {dtype})")
    peak, how = peak_bandwidth(device)
    print(f"peak {peak / 1e9:,.0f} GB/s ({how})\n")
    print("| kernel | input | kernel (us) | twin (us) | kernel GB/s | % of peak | twin / kernel |")
    print("|---|---|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    n_pair = [int(n * scale) for n in torch.randint(192, 385, (8,), generator=g).tolist()]
    cp = 128 if scale == 1 else 8
    pair_nt = padless.from_list([torch.randn(n, n, cp) for n in n_pair], ragged_dims=(0, 1)).to(device, dtype)
    seq_lens = [max(1, int(n * scale)) for n in torch.randint(16, 512, (256,), generator=g).tolist()]
    seq = padless.from_list([torch.randn(n, 768 if scale == 1 else 8) for n in seq_lens]).to(device, dtype)
    esize = pair_nt._values.element_size()

    def row(name: str, desc: str, run: Callable[[], object], nbytes: float, flops: float = 0.0) -> None:
        with kernels_mode("triton"):
            tk = bench(run, device)
        with kernels_mode("torch"):
            tt = bench(run, device)
        if flops:
            print(f"| {name} | {desc} | {tk * 1e6:,.0f} | {tt * 1e6:,.0f} | {flops / tk / 1e12:.1f} TFLOP/s | - | {tt / tk:.2f}x |")
        else:
            print(f"| {name} | {desc} | {tk * 1e6:,.0f} | {tt * 1e6:,.0f} | {nbytes / tk / 1e9:,.0f} | "
                  f"{100 * nbytes / tk / peak:.0f}% | {tt / tk:.2f}x |", flush=True)

    pv = pair_nt._values
    pbytes = pv.numel() * esize
    for dim, what in ((2, "rows"), (1, "columns")):
        gr = groups(pair_nt, [dim - 1])
        guarded(f"segment sum ({what})", lambda: row(
            f"segment sum over pair {what}", f"pair B=8 N<={max(n_pair)} C={cp}",
            lambda: segment.segment_reduce(pv, gr, "sum"), pbytes))
        guarded(f"softmax ({what})", lambda: row(
            f"softmax along pair {what}", f"pair B=8 N<={max(n_pair)} C={cp}",
            lambda: softmax.ragged_softmax(pv, gr, False), 3 * pbytes))
    gs = groups(seq, [0])
    guarded("segment logsumexp", lambda: row("segment logsumexp (tokens)", f"B=256 C={seq._values.shape[1]} T={seq._values.shape[0]}",
                                             lambda: segment.segment_reduce(seq._values, gs, "logsumexp"),
                                             seq._values.numel() * esize))
    x = padless.from_list([torch.randn(n, 1, cp) for n in n_pair]).to(device, dtype)
    y = padless.from_list([torch.randn(1, n, cp) for n in n_pair], ragged_dims=(1,)).to(device, dtype)
    meta = pair.PairMeta.from_host(torch.tensor(n_pair), torch.tensor(n_pair), device)
    xv, yv = x._values.squeeze(1), y._values.squeeze(1)
    guarded("pair", lambda: row("pair construction x[a] + y[b]", f"B=8 N<={max(n_pair)} C={cp}",
                                lambda: pair.pair_combine(xv, yv, "add", meta), pbytes))
    lm = layout.LayoutMeta.from_host(pair_nt.host_sizes(), pair_nt._ragged, list(pair_nt._env), device)
    grid_bytes = 8 * max(n_pair) ** 2 * cp * esize
    guarded("to_padded", lambda: row("packed -> padded", f"pair B=8 N<={max(n_pair)}",
                                     lambda: layout.packed_to_padded(pv, lm, 0.0), pbytes + grid_bytes))
    grid = layout.packed_to_padded(pv, lm, 0.0)
    guarded("from_padded", lambda: row("padded -> packed", f"pair B=8 N<={max(n_pair)}",
                                       lambda: layout.padded_to_packed(grid, lm, pv.shape[0]), 2 * pbytes))
    nn_ = torch.tensor(n_pair, device=device)
    offs = torch.cat([nn_.new_zeros(1), torch.cumsum(nn_ * nn_, 0)])
    guarded("transpose", lambda: row("pair transpose re-layout", f"pair B=8 N<={max(n_pair)}",
                                     lambda: layout.transpose_pair(pv, nn_, nn_, offs, max(n_pair) ** 2), 2 * pbytes))
    q = padless.from_list([torch.randn(12, n, 64) for n in seq_lens[:64]], ragged_dims=(1,)).to(device, dtype)
    k = padless.from_list([torch.randn(12, n, 64) for n in seq_lens[:64]], ragged_dims=(1,)).to(device, dtype)
    flops = sum(2 * 12 * n * n * 64 for n in seq_lens[:64])
    guarded("grouped mm", lambda: row("grouped matmul q @ k^T", "B=64 H=12 E=64", lambda: q @ k.transpose(-1, -2), 0, flops))
    a = padless.from_list([torch.randn(n, n, 32) for n in n_pair[:4]], ragged_dims=(0, 1)).to(device, dtype)
    tflops = sum(2 * n ** 3 * 32 for n in n_pair[:4])
    guarded("triangle", lambda: row("triangle einsum bikc,bjkc->bijc", "B=4 C=32",
                                    lambda: torch.einsum("bikc,bjkc->bijc", a, a), 0, tflops))
    print("\nchoices:", {k: v.backend for k, v in dispatch.explain().items()})


# ---------------------------------------------------------------------------- models


def pair_batch(device: str, dtype: torch.dtype, b: int, c: int, lo: int, hi: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (b,), generator=g).tolist()
    samples = [torch.randn(n, c, generator=g) for n in lengths]
    return lengths, padless.from_list(samples).to(device, dtype)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[], torch.Tensor]) -> None:
    opt.zero_grad(set_to_none=True)
    loss_fn().backward()
    opt.step()


def sync_check(device: str, dtype: torch.dtype, scale: float) -> None:
    from encoder import PreLNLayer
    from pair_block import Block

    section("Device syncs in one training step (torch.cuda.set_sync_debug_mode('error'))")
    print("| model | result |\n|---|---|")

    def run(name: str, model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor]) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        train_step(model, opt, loss_fn)  # warm-up: caches per-batch metadata, as a collated batch carries it
        sync(device)
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            train_step(model, opt, loss_fn)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        print(f"| {name} | no device sync |")

    blk = Block(int(384 * scale) or 8, int(128 * scale) or 8).to(device, dtype)
    _, x = pair_batch(device, dtype, 8, blk.u.in_features, max(2, int(64 * scale)), max(3, int(384 * scale)), 0)
    guarded("pair block", lambda: run("pair block (padless)", blk, lambda: blk.padless_loss(x)))
    d = max(16, int(768 * scale) // 12 * 12)
    enc = PreLNLayer(d, 12).to(device, dtype)
    g = torch.Generator().manual_seed(0)
    lens = [max(1, int(n * scale)) for n in torch.randint(16, 512, (16,), generator=g).tolist()]
    xe = padless.from_list([torch.randn(n, d, generator=g) for n in lens]).to(device, dtype)
    guarded("encoder", lambda: run("encoder layer (padless)", enc, lambda: (enc(xe) ** 2).mean()))


def peak_mem(device: str, fn: Callable[[], object]) -> float:
    if device != "cuda":
        return float("nan")
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


def pair_block(device: str, dtype: torch.dtype, scale: float, batches: int, compiled: bool) -> None:
    from pair_block import Block, hand_indices

    c, cp = max(8, int(384 * scale)), max(8, int(128 * scale))
    hi = max(3, int(384 * scale))
    section(f"Pair block B=8, C={c}, Cp={cp}, N ~ U[{hi // 4}, {hi}], {dtype}, forward + backward")
    torch.manual_seed(0)
    blk = Block(c, cp).to(device, dtype)
    impls: dict[str, list[float]] = {}
    mems: dict[str, float] = {}
    comp = torch.compile(blk.padless_loss) if compiled else None
    for i in range(batches + 1):
        lengths, x = pair_batch(device, dtype, 8, c, hi // 4, hi, i)
        pad = x.to_padded().detach()
        mask = x.mask()[..., 0].to(dtype)
        pmask = mask[:, :, None] * mask[:, None, :]
        n = torch.tensor(lengths, device=device, dtype=dtype)
        ii, jj, counts = (t.to(device) for t in hand_indices(lengths))
        counts = counts.to(dtype)
        xv = x._values.detach()
        runs = {
            "padded + masks": lambda: blk.padded_loss(pad, mask, pmask, n).backward(),
            "hand-packed": lambda: _packed(blk, xv, ii, jj, counts).backward(),
            "padless": lambda: blk.padless_loss(x).backward(),
        }
        if comp is not None:
            runs["padless compiled"] = lambda: comp(x).backward()
        for name, fn in runs.items():
            try:
                blk.zero_grad(set_to_none=True)
                t = bench(fn, device, reps=3, warmup=1)
                if i:
                    impls.setdefault(name, []).append(t)
                    mems[name] = max(mems.get(name, 0.0), peak_mem(device, fn))
            except Exception as e:
                impls[name] = []
                mems[name] = float("nan")
                print(f"({name}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
    _table(impls, mems, "padded + masks")


def _packed(blk, xv, ii, jj, counts):
    p = blk.u(xv).index_select(0, ii) + blk.v(xv).index_select(0, jj)
    p = p + blk.h(blk.ln(p))
    pm = torch.zeros(xv.shape[0], p.shape[1], dtype=p.dtype, device=p.device).index_add(0, ii, p) / counts[:, None]
    y = xv + blk.g(pm)
    return (y ** 2).mean() + (p ** 2).mean()


def encoder(device: str, dtype: torch.dtype, scale: float, batches: int, compiled: bool) -> None:
    from encoder import PreLNLayer, lengths_for

    d = max(24, int(768 * scale) // 12 * 12)
    section(f"Encoder layer d={d}, 12 heads, FFN 4x, B=16, lognormal lengths, {dtype}, forward + backward")
    torch.manual_seed(0)
    m = PreLNLayer(d, 12).to(device, dtype)
    comp = torch.compile(m) if compiled else None
    impls: dict[str, list[float]] = {}
    mems: dict[str, float] = {}
    g = torch.Generator().manual_seed(1)
    for i in range(batches + 1):
        lens = [max(1, int(n * scale)) for n in lengths_for("lognormal", 16, g)]
        x = padless.from_list([torch.randn(n, d, generator=g) for n in lens]).to(device, dtype)
        pad = x.to_padded().detach()
        keep = x.mask()[..., 0]
        runs = {
            "padded + mask": lambda: ((m(pad, attn_mask=keep[:, None, None, :]) ** 2) * keep[..., None]).sum().backward(),
            "padless": lambda: (m(x) ** 2).mean().backward(),
        }
        if comp is not None:
            runs["padless compiled"] = lambda: (comp(x) ** 2).mean().backward()
        for name, fn in runs.items():
            try:
                m.zero_grad(set_to_none=True)
                t = bench(fn, device, reps=3, warmup=1)
                if i:
                    impls.setdefault(name, []).append(t)
                    mems[name] = max(mems.get(name, 0.0), peak_mem(device, fn))
            except Exception as e:
                impls[name] = []
                mems[name] = float("nan")
                print(f"({name}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
    _table(impls, mems, "padded + mask")


def _table(impls: dict[str, list[float]], mems: dict[str, float], base: str) -> None:
    print("| implementation | median step (ms) | speed-up vs padded | peak memory (MiB) |")
    print("|---|---:|---:|---:|")
    tb = statistics.median(impls[base]) if impls.get(base) else float("nan")
    for name, ts in impls.items():
        if not ts:
            print(f"| {name} | failed | - | - |")
            continue
        t = statistics.median(ts)
        print(f"| {name} | {t * 1e3:,.2f} | {tb / t:.2f}x | {mems.get(name, float('nan')):,.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer batches, no compiled runs")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    args = ap.parse_args()
    if args.smoke:
        device, dtype, scale, batches = "cpu", torch.float32, 0.05, 1
        REPS.update(reps=1, warmup=0)
    elif not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device visible (use --smoke to exercise the script on the CPU)")
        return
    else:
        device, dtype, scale, batches = "cuda", torch.bfloat16, 1.0, (2 if args.quick else 5)
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"triton {'missing: ' + dispatch.triton_missing() if dispatch.triton_missing() else 'importable'}")
    compiled = not args.quick and not args.smoke
    if compiled and torch.__version__ < "2.12":  # TorchVersion compares as a version
        # torch 2.11's AOT autograd reads a saved SymInt as a tensor while collecting donated
        # buffers ("'SymInt' object has no attribute 'untyped_storage'"), and its dynamo binds
        # unbacked symbols only inside a tensor subclass's inner tensors, not in its outer shape
        # (PendingUnbackedSymbolNotFound on a NestedTensor's ragged extents): both relaxed here
        import torch._functorch.config as functorch_config
        import torch.fx.experimental._config as fx_config

        functorch_config.donated_buffer = False
        fx_config.soft_pending_unbacked_not_found_error = True
        print(f"torch {torch.__version__}: donated_buffer off, soft_pending_unbacked_not_found_error on "
              "for the compiled rows")
    guarded("bandwidth", lambda: bandwidth(device, dtype, scale))
    guarded("syncs", lambda: sync_check(device, dtype, scale))
    guarded("pair block", lambda: pair_block(device, dtype, scale, batches, compiled))
    guarded("encoder", lambda: encoder(device, dtype, scale, batches, compiled))


if __name__ == "__main__":
    main()
