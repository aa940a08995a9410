"""Sparse features: collate + pooled embedding lookup, padless vs a padded baseline.

    python benchmarks/jagged.py [--batch 512] [--features 8] [--max-len 60] [--dim 64] [--rounds 15]

A batch of per-sample ``{feature: ids}`` dicts (python lists, as a dataset yields them;
long-tailed lengths, some features missing) is

* padded: ``pad_sequence`` per feature + a mask, then ``F.embedding`` of the padded ids,
  a masked sum over the padded axis (``padless.jagged.reference``, the naive twin);
* hand packing: per-feature ``torch.cat`` of the ids + their offsets, ``F.embedding_bag``;
* padless: ``collate_sparse`` -> KeyedJaggedTensor -> ``embedding_bag`` -> KeyedTensor;
* TorchRec's ``EmbeddingBagCollection`` when torchrec is installed (not here).

Timed: collation alone, pooling forward + backward alone, and both; medians of
interleaved rounds from one run; ratios are per-round (padded time / this time).

A second table times the jagged types themselves against TorchRec's, side by side
(TorchRec is the baseline column; it runs only where ``torchrec`` imports, e.g. a
separate environment with ``torchrec`` and ``fbgemm-gpu-cpu``):
KJT construction from lengths, ``from_lengths_sync``, ``to_dict``, ``from_jt_dict``,
``concat``, ``permute``, ``split`` and ``to_padded_dense`` of every key. A third table
times ``regroup_kts`` and ``permute_multi_embedding`` (pooled embeddings of 3 KeyedTensors
regrouped into 3 groups) against TorchRec's, or a hand-written ``torch.cat`` without it. A
fourth times regrouping forward + backward at TorchRec's own benchmark shape (B=512, a
KeyedTensor of 20 keys x 64 and one of 20 keys x 128, each key in one of 2 random groups):
``KeyedTensor.regroup``, ``regroup_kts`` and ``permute_multi_embedding`` against two
hand-written torch baselines (per-key ``narrow`` + ``cat``; one ``index_select`` over the
concatenated columns) and TorchRec's where it imports. ``--regroup-only`` runs only the
regrouping tables (``--device cuda`` on a GPU). ``--types-only`` skips the first table; ``--only TEXT`` keeps the type cases whose name
contains TEXT; ``--cpu-time`` times with the thread's CPU clock instead of the wall clock
(on a shared, loaded machine it leaves out the time other processes hold the core).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
import types

import torch
import torch.nn.functional as F

from padless.jagged import collate_sparse, embedding_bag
from padless.jagged.reference import pad_sparse, padded_pool, random_sparse_samples
from padless.testing import bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--features", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=60)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--num-embeddings", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--types-only", action="store_true", help="only the jagged-types table (vs TorchRec)")
    ap.add_argument("--only", default="", help="jagged-types table: only the cases whose name contains this text")
    ap.add_argument("--cpu-time", action="store_true", help="time with the thread's CPU clock (a loaded machine)")
    ap.add_argument("--regroup-only", action="store_true", help="only the regrouping tables")
    ap.add_argument("--device", default="cpu", help="regrouping tables: the device (cpu, cuda)")
    args = ap.parse_args()
    if args.cpu_time:  # the runner reads time.perf_counter(): give it the thread CPU clock
        bench.time = types.SimpleNamespace(perf_counter=time.thread_time)  # type: ignore[attr-defined]
    if args.regroup_only:
        torch.set_num_threads(args.threads)
        regroup_table(args)
        return
    if args.types_only:
        torch.set_num_threads(args.threads)
        types_table(args)
        return
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    keys = [f"f{i}" for i in range(args.features)]
    samples = random_sparse_samples(args.batch, keys, max_len=args.max_len, num_embeddings=args.num_embeddings)
    tables = {k: torch.randn(args.num_embeddings, args.dim, requires_grad=True) for k in keys}

    def collate_padded():
        return pad_sparse(samples, keys)

    def collate_hand():
        out = {}
        for k in keys:
            rows = [torch.as_tensor(s.get(k, []), dtype=torch.int64) for s in samples]
            lengths = torch.tensor([r.numel() for r in rows])
            out[k] = (torch.cat(rows), torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
        return out

    def collate_padless():
        return collate_sparse(samples, keys)

    padded_batch, hand_batch, kjt = collate_padded(), collate_hand(), collate_padless()

    def step(f):
        for t in tables.values():
            t.grad = None
        f().sum().backward()

    def pool_padded(batch=padded_batch):
        ids, masks = batch
        return torch.cat([padded_pool(ids[k], masks[k], tables[k]) for k in keys], dim=1)

    def pool_hand(batch=hand_batch):
        return torch.cat(
            [F.embedding_bag(batch[k][0], tables[k], batch[k][1], mode="sum", include_last_offset=True) for k in keys],
            dim=1,
        )

    def pool_padless(batch=kjt):
        return embedding_bag(batch, tables, mode="sum").values()

    # same result everywhere (forward and gradients)
    ref = pool_padded()
    torch.testing.assert_close(pool_hand(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool_padless(), ref, rtol=1e-4, atol=1e-4)

    ids, masks = padded_batch
    real = sum(kjt.length_per_key())
    padded = sum(int(ids[k].numel()) for k in keys)
    occupancy = real / padded
    print(
        f"B={args.batch}, {args.features} features, lengths 0..{args.max_len} (long-tailed, 10% missing), "
        f"D={args.dim}, tables {args.num_embeddings} rows, {args.threads} thread(s), torch {torch.__version__}"
    )
    print(
        f"ids: {real:,} real, {padded:,} padded (occupancy {occupancy:.2f}); padded embedding activation "
        f"{padded * args.dim * 4 / 2**20:.1f} MB, padless pooled output only {args.batch * args.features * args.dim * 4 / 2**20:.1f} MB"
    )
    notes = {}
    impls_c = {"padded": collate_padded, "hand packing": collate_hand, "padless": collate_padless}
    impls_p = {
        "padded": lambda: step(pool_padded),
        "hand packing": lambda: step(pool_hand),
        "padless": lambda: step(pool_padless),
    }
    impls_t = {
        "padded": lambda: step(lambda: pool_padded(collate_padded())),
        "hand packing": lambda: step(lambda: pool_hand(collate_hand())),
        "padless": lambda: step(lambda: pool_padless(collate_padless())),
    }
    if importlib.util.find_spec("torchrec") is None:
        notes["torchrec"] = "not installed"
    rows = []
    rows += bench.rows_from("collate", bench.interleaved(impls_c, baseline="padded", rounds=args.rounds))
    rows += bench.rows_from("pool fwd+bwd", bench.interleaved(impls_p, baseline="padded", rounds=args.rounds))
    rows += bench.rows_from("collate + pool fwd+bwd", bench.interleaved(impls_t, baseline="padded", rounds=args.rounds))
    bench.print_table(rows, "sparse features: collate + pooled embedding lookup", "padded")
    if notes:
        print(f"\nTorchRec (KeyedJaggedTensor + EmbeddingBagCollection): {notes['torchrec']}, not run")
    types_table(args)


def types_table(args: argparse.Namespace) -> None:
    """The jagged types' own operations, padless vs TorchRec (when importable)."""
    from padless.jagged import JaggedTensor, KeyedJaggedTensor

    torch.manual_seed(1)
    b, keys = args.batch, [f"f{i}" for i in range(args.features)]
    lengths = torch.randint(0, args.max_len // 2, (b * len(keys),), dtype=torch.int32)
    values = torch.randint(0, args.num_embeddings, (int(lengths.sum()),))
    half = len(keys) // 2
    libs = {"padless": (JaggedTensor, KeyedJaggedTensor)}
    try:
        from torchrec.sparse.jagged_tensor import JaggedTensor as TJ, KeyedJaggedTensor as TK

        libs = {"torchrec": (TJ, TK), **libs}
    except ImportError:
        pass

    def cases(J, K):  # noqa: N803 - the two classes under test
        kjt = K.from_lengths_sync(keys, values, lengths)
        jt_dict = kjt.to_dict()
        parts = kjt.split([half, len(keys) - half])
        perm = list(range(len(keys)))[::-1]
        return {
            "KJT(keys, values, lengths)": lambda: K(keys, values, lengths=lengths),
            "from_lengths_sync": lambda: K.from_lengths_sync(keys, values, lengths),
            "to_dict (fresh KJT)": lambda: K.from_lengths_sync(keys, values, lengths).to_dict(),
            "from_jt_dict": lambda: K.from_jt_dict(jt_dict),
            "concat (2 KJTs)": lambda: K.concat(parts),
            "permute (reverse)": lambda: kjt.permute(perm),
            "split (2 groups)": lambda: kjt.split([half, len(keys) - half]),
            "to_padded_dense (every key)": lambda: [jt.to_padded_dense() for jt in jt_dict.values()],
        }

    per_lib = {name: cases(*cls) for name, cls in libs.items()}
    base = "torchrec" if "torchrec" in libs else "padless"
    rows = []
    for case in per_lib["padless"]:
        if args.only not in case:
            continue
        impls = {name: per_lib[name][case] for name in libs}
        rows += bench.rows_from(case, bench.interleaved(impls, baseline=base, rounds=max(args.rounds, 30), inner=5))
    clock = "thread CPU time" if args.cpu_time else "wall clock"
    print(
        f"\nB={b}, {len(keys)} keys, lengths U[0, {args.max_len // 2}), {int(lengths.sum()):,} values, "
        f"{torch.get_num_threads()} thread(s), {clock}, load average {os.getloadavg()[0]:.2f}"
    )
    bench.print_table(rows, "jagged types: padless vs TorchRec (ratio > 1: faster than TorchRec)", base)
    if base == "padless":
        print("\nTorchRec is not importable here: only padless was timed.")
    regroup_table(args)


def regroup_table(args: argparse.Namespace) -> None:
    """Pooled embeddings regrouped by key: ``regroup_kts`` and ``permute_multi_embedding``
    against TorchRec's (when importable), else against a hand-written ``torch.cat`` of
    precomputed column slices."""
    from padless.jagged import KeyedTensor, permute_multi_embedding, regroup_kts

    torch.manual_seed(2)
    b, dim, n_kt, per_kt = args.batch, args.dim, 3, max(args.features, 2)
    keys = [[f"t{t}_f{i}" for i in range(per_kt)] for t in range(n_kt)]
    kts = [KeyedTensor.from_tensor_list(ks, [torch.randn(b, dim) for _ in ks]) for ks in keys]
    flat = [k for ks in keys for k in ks]
    perm = torch.randperm(len(flat), generator=torch.Generator().manual_seed(3)).tolist()
    groups = [[flat[i] for i in perm[: len(flat) // 2]], [flat[i] for i in perm[len(flat) // 2 :]], flat[: per_kt // 2]]
    where = {k: (t, i * dim) for t, ks in enumerate(keys) for i, k in enumerate(ks)}
    vals = [kt.values() for kt in kts]

    def by_hand():
        return [torch.cat([vals[where[k][0]][:, where[k][1] : where[k][1] + dim] for k in g], 1) for g in groups]

    ref = by_hand()
    for fn in (regroup_kts, permute_multi_embedding):
        for got, want in zip(fn(kts, groups), ref):
            torch.testing.assert_close(got, want)
    try:
        from torchrec.sparse import jagged_tensor as trc

        theirs = [kt.to_torchrec() for kt in kts]
        base = {
            "regroup_kts": ("torchrec", lambda: trc.regroup_kts(theirs, groups)),
            "permute_multi_embedding": ("torchrec", lambda: trc.permute_multi_embedding(theirs, groups)),
        }
    except (ImportError, RuntimeError, AttributeError):
        base = {name: ("torch.cat by hand", by_hand) for name in ("regroup_kts", "permute_multi_embedding")}
    mine = {"regroup_kts": lambda: regroup_kts(kts, groups), "permute_multi_embedding": lambda: permute_multi_embedding(kts, groups)}
    rows = []
    for case, (name, f) in base.items():
        if args.only not in case:
            continue
        impls = {name: f, "padless": mine[case]}
        rows += bench.rows_from(case, bench.interleaved(impls, baseline=name, rounds=max(args.rounds, 30), inner=5))
    print(
        f"\nB={b}, {n_kt} KeyedTensors x {per_kt} keys of width {dim}, groups of "
        f"{[len(g) for g in groups]} keys, {torch.get_num_threads()} thread(s)"
    )
    bench.print_table(rows, "regrouping pooled embeddings (ratio > 1: faster than the baseline)", base["regroup_kts"][0])
    regroup_backward_table(args)


def regroup_backward_table(args: argparse.Namespace) -> None:
    """Regrouping forward + backward at TorchRec's benchmark shape
    (``torchrec/sparse/tests/jagged_tensor_benchmark.py``: ``build_kts`` + ``build_groups``)."""
    import random

    from padless.jagged import KeyedTensor, permute_multi_embedding, regroup_kts

    dev, b, n = args.device, 512, 20
    torch.manual_seed(5)
    rng = random.Random(5)
    leaves = [torch.randn(b, n * w, device=dev, requires_grad=True) for w in (64, 128)]
    keys = [[f"{name}_{i}" for i in range(n)] for name in ("dense", "sparse")]
    kts = [KeyedTensor(ks, [w] * n, v) for ks, w, v in zip(keys, (64, 128), leaves)]
    flat = [k for ks in keys for k in ks]
    alloc = [rng.randrange(2) for _ in flat]
    groups = [[k for k, a in zip(flat, alloc) if a == g] for g in range(2)]
    where = {k: (t, s, w) for t, kt in enumerate(kts) for k, s, w in zip(kt.keys(), kt.offset_per_key(), kt.length_per_key())}
    base_col = [0, leaves[0].shape[1]]
    idx = torch.tensor([base_col[where[k][0]] + where[k][1] + j for g in groups for k in g for j in range(where[k][2])], device=dev)
    widths = [sum(where[k][2] for k in g) for g in groups]
    upstream = [torch.randn(b, w, device=dev) for w in widths]

    def narrow_cat():
        return [torch.cat([leaves[where[k][0]].narrow(1, where[k][1], where[k][2]) for k in g], 1) for g in groups]

    def index_select():
        return list(torch.cat(leaves, 1).index_select(1, idx).split(widths, 1))

    impls = {
        "torch narrow+cat": narrow_cat,
        "torch index_select": index_select,
        "padless KeyedTensor.regroup": lambda: KeyedTensor.regroup(kts, groups),
        "padless regroup_kts": lambda: regroup_kts(kts, groups),
        "padless permute_multi_embedding": lambda: permute_multi_embedding(kts, groups),
    }
    baseline = "torch narrow+cat"
    try:
        from torchrec.sparse import jagged_tensor as trc

        theirs = [kt.to_torchrec() for kt in kts]
        impls = {
            "torchrec KeyedTensor.regroup": lambda: trc.KeyedTensor.regroup(theirs, groups),
            "torchrec regroup_kts": lambda: trc.regroup_kts(theirs, groups),
            "torchrec permute_multi_embedding": lambda: trc.permute_multi_embedding(theirs, groups),
            **impls,
        }
        baseline = "torchrec KeyedTensor.regroup"
    except (ImportError, RuntimeError, AttributeError):
        pass

    def step(f):
        for v in leaves:
            v.grad = None
        torch.autograd.backward(f(), upstream)

    want = None
    for name, f in impls.items():  # same outputs and gradients everywhere
        out = [o.detach() for o in f()]
        step(f)
        got = out + [v.grad for v in leaves]
        if want is None:
            want = got
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, msg=lambda m: f"{name}: {m}")
    clock = time.thread_time if args.cpu_time and dev == "cpu" else time.perf_counter
    result = bench.interleaved(
        {name: (lambda f=f: step(f)) for name, f in impls.items()},
        baseline=baseline, rounds=args.rounds, device=dev, clock=clock,
    )
    print(
        f"\nB={b}, KeyedTensors of {n} keys x 64 and {n} keys x 128, groups of {[len(g) for g in groups]} keys, "
        f"forward + backward, {dev}, {torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.2f}"
    )
    bench.print_table(bench.rows_from("regroup fwd+bwd", result), "regrouping forward + backward (ratio > 1: faster than the baseline)", baseline)


if __name__ == "__main__":
    main()
