"""Every check that needs a GPU, in one prepared run (for sessions that are lent one).

    python benchmarks/gpu_check.py [--quick]

1. the CUDA-only tests (they skip on CPU machines);
2. an attention spot check: the varlen / flash / flex backends against per-sample SDPA,
   forward and backward, bf16, with the backend each call chose;
3. a Batch moved to the GPU: the number of host-to-device copies;
4. ``benchmarks/encoder.py --device cuda`` (skipped with ``--quick``);
5. the Triton kernel tests on CUDA (``tests/ops/kernels``: every kernel against its twin);
6. ``benchmarks/kernels_gpu.py``: per-kernel bandwidth against the device's peak, zero
   device syncs in a training step (``set_sync_debug_mode("error")``) of the pair block
   and the encoder, the pair block (B=8, C=384/128, N up to 384) and a BERT-base-like
   encoder layer in bf16, eager and compiled, against padding and hand packing, with
   peak memory.
7. ``benchmarks/vision.py --device cuda``: the ResNet-style classifier train step on packed
   images vs padded vs per-image, with CUDA peak memory (skipped with ``--quick``).
8. ``benchmarks/pairformer.py --device cuda --dtype bfloat16 --syncs --counts``: a Pairformer
   layer (boltz's when installed, else the stand-in) under bf16 autocast, padless vs padded
   per piece, one step under ``set_sync_debug_mode("error")``, aten ops at B=4 and B=16
   (skipped with ``--quick``).
9. ``benchmarks/hf.py --device cuda --dtype bfloat16 --syncs``: tiny BERT and Llama train steps,
   padded vs ``inputs_embeds=nt`` vs the FlatteningCollator, with the ``sdpa`` and ``padless``
   attention implementations, against the FLOP ideal, after one step of every padless path
   under ``set_sync_debug_mode("error")`` (needs ``transformers``; skipped without it and
   with ``--quick``).
10. ``benchmarks/host_time.py --device cuda``: host time per training step (CPU time of the
   Python thread that launches it) against the step's GPU time, for the encoder, the
   Pairformer layer and a ResNet-style CNN, padless and padded, each on new batches: a ratio
   above 1 means the step is host-bound (kept with ``--quick``: it is short).

Prints one summary line per step and exits 0 (a failed step is reported in its
summary); ``--strict`` exits non-zero when a step failed. ``--budget SECONDS`` fits the run
into a lease (a lent GPU machine gives a session about 15 minutes in all, 10 per command): each
step's timeout is what is left of the budget, and steps that would start with under 20 s left
are reported as skipped. ``--log PATH`` also writes every line there as it is printed (put it
under the device tool's ``$OUT`` so a run stopped at its limit still returns its log)::

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_check.py --budget 540 --log $OUT/gpu_check.log
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


STEP_TIMEOUT = 1800.0  # seconds, without --budget
MIN_STEP = 20.0  # seconds: a step that would start with less budget left is skipped
_DEADLINE: list[float] = []  # time.perf_counter() at which --budget runs out
_LOG: list = []  # the --log file


def say(text: str) -> None:
    print(text, flush=True)
    for f in _LOG:
        f.write(text + "\n")
        f.flush()


def step(name: str, cmd: list[str], tail_lines: int = 15) -> bool | None:
    """Run one check; True / False for ok / failed, None when the budget left no time for it."""
    timeout = STEP_TIMEOUT
    if _DEADLINE:
        timeout = min(timeout, _DEADLINE[0] - time.perf_counter())
        if timeout < MIN_STEP:
            say(f"== {name}: skipped ({max(timeout, 0):.0f} s of the budget left)")
            return None
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))
        say(f"== {name}: FAILED (timed out after {e.timeout:.0f} s)")
        say("\n".join("   " + line for line in out.strip().splitlines()[-tail_lines:]))
        return False
    ok = proc.returncode == 0
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-tail_lines:]
    say(f"== {name}: {'ok' if ok else 'FAILED'} ({time.perf_counter() - t0:.0f} s)")
    say("\n".join("   " + line for line in tail))
    return ok


ATTENTION_CHECK = r"""
import torch, torch.nn.functional as F, padless
from padless.ops.attention import sdpa as attn
from padless.testing import assert_close_samples
torch.manual_seed(0)
for causal in (False, True):
    for lk in ([17, 33, 5, 64], None):
        lq = [17, 33, 5, 64]
        q = padless.from_list([torch.randn(4, n, 64) for n in lq], ragged_dims=(1,)).to("cuda", torch.bfloat16)
        lk = lk or lq
        k = padless.from_list([torch.randn(4, n, 64) for n in lk], ragged_dims=(1,)).to("cuda", torch.bfloat16)
        v = padless.from_list([torch.randn(4, n, 64) for n in lk], ragged_dims=(1,)).to("cuda", torch.bfloat16)
        for t in (q, k, v):
            t.requires_grad_()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        print(attn.last_choice)
        refs = [F.scaled_dot_product_attention(a, b, c, is_causal=causal) for a, b, c in zip(q.unbind(), k.unbind(), v.unbind())]
        assert_close_samples(out, refs, atol=3e-2, rtol=3e-2)
        out.sum().backward()
print("attention ok")
"""

TRANSFER_CHECK = r"""
import torch, padless
from unittest import mock
c = padless.Collator({"ids": padless.Field(ragged=0, position_ids="pos"), "x": padless.Field(pair=True)})
b = c([{"ids": torch.arange(n), "x": torch.randn(n, 8)} for n in (5, 9, 3)]).pin_memory()
copies = []
real = torch.Tensor.copy_
def counting(self, src, non_blocking=False):
    if self.device.type == "cuda" and src.device.type == "cpu":
        copies.append(src.numel())
    return real(self, src, non_blocking)
with mock.patch.object(torch.Tensor, "copy_", counting):
    g = b.to("cuda", non_blocking=True)
torch.cuda.synchronize()
print("host-to-device copies:", len(copies), "dtypes:", sorted({str(t.dtype) for t in g.values() if isinstance(t, torch.Tensor)}))
p = g.x.unsqueeze(2) + g.x.unsqueeze(1)
print("pair on cuda:", tuple(p.shape), p.device)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--strict", action="store_true", help="exit non-zero when a step failed")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (steps past it are skipped)")
    ap.add_argument("--log", default=None, help="also write every line to this file as it is printed")
    args = ap.parse_args()
    if args.budget is not None:
        _DEADLINE.append(time.perf_counter() + args.budget)
    if args.log:
        _LOG.append(open(args.log, "a"))
    import torch

    if not torch.cuda.is_available():
        say("gpu_check: no CUDA device visible")
        raise SystemExit(1)
    say(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    py = sys.executable
    results = [
        step("CUDA tests", [py, "-m", "pytest", "-q", "-k", "cuda", "-p", "no:cacheprovider", "tests"]),
        step("attention backends", [py, "-c", ATTENTION_CHECK]),
        step("batch transfer", [py, "-c", TRANSFER_CHECK]),
    ]
    if not args.quick:
        results.append(step("encoder benchmark (bf16)", [py, "benchmarks/encoder.py", "--device", "cuda", "--batches", "4"]))
    results.append(step("Triton kernel tests (CUDA)", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/ops/kernels"]))
    kernels_cmd = [py, "benchmarks/kernels_gpu.py"] + (["--quick"] if args.quick else [])
    results.append(step("kernels: bandwidth, syncs, pair block, encoder", kernels_cmd, tail_lines=120))
    if not args.quick:
        results.append(step("vision benchmark (ResNet-style)", [py, "benchmarks/vision.py", "--device", "cuda", "--rounds", "10"]))
        results.append(step("Pairformer layer (bf16 autocast, zero syncs, ops per step)",
                            [py, "benchmarks/pairformer.py", "--device", "cuda", "--dtype", "bfloat16", "--clock", "wall",
                             "--rounds", "10", "--syncs", "--counts"], tail_lines=25))
        try:
            import transformers  # noqa: F401
        except ImportError:
            say("== transformers rows: skipped (pip install transformers to run benchmarks/hf.py on the GPU)")
        else:
            results.append(step("transformers (bf16 autocast, zero syncs, FLOP ideal)",
                                [py, "benchmarks/hf.py", "--device", "cuda", "--dtype", "bfloat16", "--syncs",
                                 "--rounds", "10"], tail_lines=25))
    results.append(step("host time per step (host-bound?)", [py, "benchmarks/host_time.py", "--device", "cuda",
                                                            "--steps", "5" if args.quick else "10"], tail_lines=10))
    failed = sum(r is False for r in results)
    skipped = sum(r is None for r in results)
    say(f"== gpu_check: {len(results) - failed - skipped} of {len(results)} steps ok, {failed} failed, {skipped} skipped")
    if failed and args.strict:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
