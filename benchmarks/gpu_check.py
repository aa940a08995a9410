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

Prints one summary line per step and exits 0 (a failed step is reported in its
summary); ``--strict`` exits non-zero when a step failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def step(name: str, cmd: list[str], tail_lines: int = 15) -> bool:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired as e:
        print(f"== {name}: FAILED (timed out after {e.timeout:.0f} s)")
        return False
    ok = proc.returncode == 0
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-tail_lines:]
    print(f"== {name}: {'ok' if ok else 'FAILED'} ({time.perf_counter() - t0:.0f} s)")
    print("\n".join("   " + line for line in tail))
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
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device visible")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
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
            print("== transformers rows: skipped (pip install transformers to run benchmarks/hf.py on the GPU)")
        else:
            results.append(step("transformers (bf16 autocast, zero syncs, FLOP ideal)",
                                [py, "benchmarks/hf.py", "--device", "cuda", "--dtype", "bfloat16", "--syncs",
                                 "--rounds", "10"], tail_lines=25))
    failed = sum(not r for r in results)
    print(f"== gpu_check: {len(results) - failed} of {len(results)} steps ok")
    if failed and args.strict:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
