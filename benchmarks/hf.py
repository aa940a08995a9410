"""Hugging Face transformers models: padded vs padless, train step, with the FLOP ideal.

    zoo/.venv/bin/python benchmarks/hf.py [--batches 5] [--rounds 3] [--threads 2] [--clock wall|cpu]
                                          [--models bert,llama] [--batch-size 8] [--attn sdpa,padless]
                                          [--device cpu|cuda] [--dtype float32|bfloat16] [--syncs]

Tiny randomly initialised ``BertModel`` and ``LlamaModel`` (hidden 128, 2 layers, 4
heads, FFN 512, vocab 1000), lengths U[16, 256], B=8, forward + backward of the mean of
``last_hidden_state ** 2`` over the real tokens. Each batch runs every path round-robin
(:func:`padless.testing.bench.interleaved`); the table gives medians over batches of the
per-batch median time and of the per-batch ratio against the padded batch:

* ``padded + mask``: ``input_ids`` padded to the longest sample with ``attention_mask``
  (sdpa attention), the baseline;
* ``inputs_embeds=nt (<attn>)``: ``model(inputs_embeds=emb(ids_nt))`` with nothing else,
  ``ids_nt`` a NestedTensor of the ids (no padded position anywhere);
* ``collator (<attn>)``: one packed ``(1, T)`` row from :class:`padless.FlatteningCollator`
  (BERT with sdpa needs ``block_mask=True``, a ``T x T`` mask; ``padless`` attention reads
  ``cu_seq_lens``).

The ``of ideal`` note is the measured speed-up over the FLOP ideal of that batch: padded
FLOPs over packed FLOPs, where the linears and norms scale with the tokens (1/occupancy)
and attention with ``sum L_i^2 / (B Lmax^2)`` (``6 * matmul params`` per token, ``14 d``
per score forward + backward, as in ``benchmarks/encoder.py``).

``--device cuda --dtype bfloat16`` runs the same on a GPU under bf16 autocast (the padless
attention then takes varlen flash where ``flash-attn`` is installed, else torch's SDPA per
length group); ``--syncs`` first runs one step of every padless path under
``torch.cuda.set_sync_debug_mode("error")``, so a step that synchronises the device raises,
naming the op. ``benchmarks/gpu_check.py`` runs this as its transformers step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import padless
from padless.testing import bench

D, LAYERS, HEADS, FFN, VOCAB = 128, 2, 4, 512, 1000


def build(kind: str, attn: str) -> torch.nn.Module:
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, max_position_embeddings=512, attn_implementation=attn)
    torch.manual_seed(0)
    if kind == "bert":
        cfg = transformers.BertConfig(**common, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return transformers.BertModel(cfg, add_pooling_layer=False).train()
    cfg = transformers.LlamaConfig(**common, num_key_value_heads=HEADS)
    return transformers.LlamaModel(cfg).train()


def embed(model: torch.nn.Module):
    return model.get_input_embeddings()


def flop_ideal(kind: str, lengths: list[int]) -> float:
    """Padded FLOPs over packed FLOPs of one forward + backward step."""
    params = 4 * D * D + (2 if kind == "bert" else 3) * D * FFN  # matmul weights per layer
    per_token, per_score = 6 * params, 14 * D
    b, lmax = len(lengths), max(lengths)
    padded = b * lmax * per_token + b * lmax * lmax * per_score
    packed = sum(lengths) * per_token + sum(n * n for n in lengths) * per_score
    return padded / packed


def autocast(device: str, dtype: torch.dtype):
    """bf16 autocast on ``device`` (a no-op context for float32)."""
    return torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32)


def steps(kind: str, attns: list[str], ids: list[torch.Tensor], device: str = "cpu",
          dtype: torch.dtype = torch.float32) -> dict[str, object]:
    """The timed train steps of one batch, by path name."""
    lengths = [len(t) for t in ids]
    b, lmax = len(ids), max(lengths)
    pad = torch.zeros(b, lmax, dtype=torch.long)
    keep = torch.zeros(b, lmax, dtype=torch.bool)
    for i, t in enumerate(ids):
        pad[i, : len(t)] = t
        keep[i, : len(t)] = True
    pad, keep = pad.to(device), keep.to(device)
    ids_nt = padless.from_list(ids).to(device)  # host sizes stay with the structure
    feats = [{"input_ids": t.tolist()} for t in ids]
    models = {a: build(kind, a).to(device) for a in {"sdpa", *attns}}
    out: dict[str, object] = {}

    def padded_step(m=models["sdpa"]):
        with autocast(device, dtype):
            y = m(input_ids=pad, attention_mask=keep.long(), use_cache=False).last_hidden_state
            loss = ((y.float() ** 2) * keep[..., None]).sum().div(keep.sum() * D)
        loss.backward()

    out["padded + mask"] = padded_step
    for attn in attns:
        m = models[attn]

        def nt_step(m=m):
            with autocast(device, dtype):
                y = m(inputs_embeds=embed(m)(ids_nt), use_cache=False).last_hidden_state
                loss = (y.float() ** 2).mean()
            loss.backward()

        out[f"inputs_embeds=nt ({attn})"] = nt_step
        causal = kind == "llama"
        collator = padless.FlatteningCollator(causal=causal, block_mask=(not causal and attn in ("sdpa", "eager")))
        batch = collator(feats)
        batch.pop("labels")
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

        def collated_step(m=m, batch=batch):
            with autocast(device, dtype):
                y = m(**batch).last_hidden_state
                loss = (y.float() ** 2).mean()
            loss.backward()

        out[f"collator ({attn})"] = collated_step
    return out


def check_syncs(kind: str, impls: dict[str, object]) -> None:
    """Run every padless path once with device syncs turned into errors (after a warm-up step,
    which may build plans and probe backends)."""
    for name, fn in impls.items():
        if name == "padded + mask":
            continue
        bench.without_syncs(fn)
        print(f"{kind} {name}: zero device syncs in a train step (set_sync_debug_mode('error') raised nothing)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--models", default="bert,llama")
    ap.add_argument("--attn", default="sdpa,padless", help="attention implementations of the padless paths")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall time, or CPU time of this process")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="bfloat16: autocast")
    ap.add_argument("--syncs", action="store_true",
                    help="(CUDA) first run one step of every padless path under set_sync_debug_mode('error')")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    cuda = torch.device(args.device).type == "cuda"
    torch.set_num_threads(args.threads)
    attns = args.attn.split(",")
    if "padless" in attns:
        try:
            import padless.hf  # noqa: F401  (registers attn_implementation="padless" with transformers)
        except ImportError:
            attns.remove("padless")
    load0 = os.getloadavg()
    rows: list[bench.Row] = []
    for kind in args.models.split(","):
        g = torch.Generator().manual_seed(1)
        times: dict[str, list[float]] = {}
        ratios: dict[str, list[float]] = {}
        ideals, occ = [], []
        for batch_i in range(args.batches):
            lengths = torch.randint(16, 257, (args.batch_size,), generator=g).tolist()
            ids = [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]
            ideals.append(flop_ideal(kind, lengths))
            occ.append(sum(lengths) / (len(lengths) * max(lengths)))
            impls = steps(kind, attns, ids, args.device, dtype)
            if args.syncs and cuda and batch_i == 0:  # once per model
                check_syncs(kind, impls)
            res = bench.interleaved(impls, baseline="padded + mask", rounds=args.rounds, warmup=1,
                                    device=args.device if cuda else None,
                                    clock=time.process_time if args.clock == "cpu" else time.perf_counter)
            for name, (t, r) in res.items():
                times.setdefault(name, []).append(t)
                ratios.setdefault(name, []).append(r)
        ideal = statistics.median(ideals)
        case = f"{kind} d={D} {LAYERS} layers B={args.batch_size} U[16,256] (occ {statistics.mean(occ):.2f})"
        for name in times:
            r = statistics.median(ratios[name])
            note = f"FLOP ideal {ideal:.2f}x" if name == "padded + mask" else f"{r / ideal:.2f} of ideal"
            rows.append(bench.Row(case, name, statistics.median(times[name]), r, note))
    load1 = os.getloadavg()
    bench.print_table(
        rows,
        f"transformers train step (fwd+bwd), {args.device} {args.dtype}, {args.threads} threads, {args.clock} clock, {args.batches} batches x {args.rounds} rounds, "
        f"torch {torch.__version__}, load average {load0[0]:.1f} at start, {load1[0]:.1f} at end",
        "padded + mask",
    )


if __name__ == "__main__":
    main()
