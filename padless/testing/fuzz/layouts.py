"""Layout steps: folds of a ragged dim into the batch and back, the sequence-first view,
einsum with an ellipsis, and recurrent modules (issue 41's idioms), each written once for
both sides (on a sample the fold, the view and the batch dim are the identity)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from padless.tensor.core import NestedTensor
from padless.testing.fuzz.core import Chooser, Step, seeded


def layout_steps(x: NestedTensor, c: Chooser, seed: int) -> dict[str, list[Callable[[], Step]]]:
    """Builders of the layout steps that apply to ``x``."""
    out: dict[str, list[Callable[[], Step]]] = {"layout": []}
    ragged, d_n, order = x.ragged_dims, x.sample_dim, tuple(x.storage_order)
    static_last = d_n >= 1 and (d_n - 1) not in ragged and x.shape[-1] >= 1
    tokens = ragged == (0,) and d_n == 2 and static_last and order == (0, 1)
    pairs = ragged == (0, 1) and d_n == 3 and static_last and order == (0, 1, 2)
    e = int(x.shape[-1])

    if pairs:
        def fold_rows() -> Step:
            red = c.choice(["softmax", "cumsum", "mean"])
            how = c.choice(["reshape", "flatten"])  # flatten: unflatten(0, (B, N)) back, no size of j named

            def fn(t, o):
                if not o:  # each row i of the sample is its own sample (j, d)
                    return _row_op(t, red, 1)
                b, n, m = t.shape[0], t.shape[1], t.shape[2]
                if how == "flatten":
                    return _row_op(t.flatten(0, 1), red, 1).unflatten(0, (b, n))
                zf = t.reshape(b * n, m, e)  # '(b i) j d'
                return _row_op(zf, red, 1).reshape(b, n, m, e)

            return Step(f"fold rows (b i) j d by {how}, {red} over j, unfold", fn, family="layout")

        out["layout"].append(fold_rows)
        hs = x.host_sizes()
        if bool((hs[:, 0] == hs[:, 1]).all()):
            def fold_attention() -> Step:
                def fn(t, o):  # row attention with the pair's channel 0 as a bias over (j, j')
                    if not o:
                        q = t.unsqueeze(1)  # rows i as the batch: (N, 1, N, e)
                        return F.scaled_dot_product_attention(q, q, q, attn_mask=t[..., 0][None, None]).squeeze(1)
                    b, n = t.shape[0], t.shape[1]
                    q = t.reshape(b * n, n, e).unsqueeze(1)  # '(b i) 1 j d'
                    bias = t[..., 0].unsqueeze(1).repeat_interleave(n, dim=0)  # '(b i) 1 j k'
                    return F.scaled_dot_product_attention(q, q, q, attn_mask=bias).squeeze(1).reshape(b, n, n, e)

                return Step("fold rows (b i) j d, SDPA with the bias repeated per row, unfold", fn, family="layout")

            out["layout"].append(fold_attention)

            def pair_bias_attention() -> Step:
                w = seeded(seed + 7, (e, 2), x.dtype)
                # a scale (boltz's 1/sqrt(d)) or none; values as wide as the keys or narrower: the
                # fused node reads q, k and v straight into its matmul layout (ops.pairs.attend_direct)
                scale, dv = c.choice([1.0, 0.5]), c.integer(1, e)

                def fn(t, o):  # boltz's AttentionPairBias core: tokens from the pair, a bias per head
                    s = t.mean(-3)  # (.., N, e): one token per column
                    q = s.unsqueeze(-2).expand(*s.shape[:-1], 2, e)  # two heads
                    v = (q * 2)[..., :dv]
                    bias = t @ w  # (.., N, N, 2), read as (.., 2, N, N)
                    if not o:
                        a = torch.einsum("ihd,jhd->hij", q, q) * scale + bias.permute(2, 0, 1)
                        return torch.einsum("hij,jhd->ihd", a.softmax(-1), v)
                    a = torch.einsum("bihd,bjhd->bhij", q, q) * scale + bias.permute(0, 3, 1, 2)
                    return torch.einsum("bhij,bjhd->bihd", a.softmax(-1), v)

                return Step("pair-biased attention (q k^T + z W as (H, N, N), softmax, @ v)", fn, family="layout")

            out["layout"].append(pair_bias_attention)

    if tokens or pairs:
        def chunk_rows() -> Step:
            alloc, size = c.choice(["empty", "new_zeros", "from_chunk", "empty_like", "cat"]), c.integer(1, 4)
            w2 = e if alloc == "empty_like" else c.integer(1, 3)
            w = seeded(seed + 2, (w2, e), x.dtype)

            def fn(t, o):
                return _chunked_rows(t, alloc, size, lambda r: torch.tanh(F.linear(r, w)), e, w2)

            return Step(f"rows rebuilt chunk by chunk ({alloc}, chunks of {size}, {e} -> {w2})", fn, family="layout")

        out["layout"].append(chunk_rows)

    if tokens:
        def seq_first() -> Step:
            w = seeded(seed, (e,), x.dtype)

            def fn(t, o):
                if not o:
                    return F.layer_norm(t * w + 1, (e,)) + t
                u = t.transpose(0, 1)  # (T, B, E)
                return (F.layer_norm(u * w + 1, (e,)) + u).transpose(0, 1)

            return Step("sequence-first view: layer_norm + residual, back", fn, family="layout")

        def einsum_ellipsis() -> Step:
            w = seeded(seed + 1, (e, 3), x.dtype)
            eq = c.choice(["...d,de->...e", "...id,...jd->...ij"])
            return Step(f"einsum({eq!r})", lambda t, o: torch.einsum(eq, t, w) if "de" in eq else torch.einsum(eq, t, t),
                        family="layout")

        out["layout"] += [seq_first, einsum_ellipsis]
        if x.dtype != torch.bfloat16 and min((int(n) for n in x.host_sizes()[:, 0].tolist()), default=0) > 0:
            def recurrent() -> Step:
                kind = c.choice(["LSTM", "GRU", "RNN"])
                bi = c.choice([False, True])
                layers = c.choice([1, 2])  # on the CPU: padless's own recurrence (ops/recurrent/loop.py)
                torch.manual_seed(seed)
                mod = getattr(torch.nn, kind)(e, 3, num_layers=layers, batch_first=True, bidirectional=bi).to(x.dtype)

                def fn(t, o):
                    return mod(t)[0] if o else mod(t[None])[0][0]

                return Step(f"nn.{kind}(batch_first, bidirectional={bi}, num_layers={layers})", fn, family="layout")

            out["layout"].append(recurrent)
    return {k: v for k, v in out.items() if v}


def _row_op(t, red: str, d: int):
    if red == "softmax":
        return t.softmax(d)
    if red == "cumsum":
        return t.cumsum(d)
    return t - t.mean(d, keepdim=True)


def _chunked_rows(t, alloc: str, size: int, f: Callable, e: int, w2: int):
    """OpenFold's ``chunk_layer`` (and a Pairformer's transition): the batch as rows, a dense
    tensor of as many rows filled chunk by chunk with a row-wise ``f``, reshaped to the batch."""
    other = t.shape[:-1]
    rows = t.reshape(-1, e)
    n = rows.shape[0]
    if n == 0:  # no rows (a sample alone, or a batch of empty samples): no chunk; keep the graph
        return f(rows).reshape(*other, w2)
    if alloc == "cat":  # the chunked forward written with a join
        return torch.cat([f(p) for p in rows.split(size)]).reshape(*other, w2)
    out = None
    if alloc == "empty":
        out = torch.empty((n, w2), dtype=rows.dtype)
    elif alloc == "new_zeros":
        out = rows.new_zeros((n, w2))
    elif alloc == "empty_like":
        out = torch.empty_like(rows)
    for s in range(0, n, size):
        y = f(rows[s : s + size])
        if out is None:
            out = y.new_zeros((n,) + tuple(y.shape[1:]))
        out[s : s + size] = y
    return out.reshape(*other, w2)
