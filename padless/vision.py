"""Native-resolution ViT helpers: per-image position embeddings and token dropping, packed
to match :func:`padless.patchify` tokens.

Every image ``(C, H_i, W_i)`` cut into ``p x p`` patches has a patch grid ``(h_i, w_i) =
(H_i / p, W_i / p)`` and ``N_i = h_i * w_i`` tokens, row-major over the grid. The helpers
here give each token its position, computed once per distinct grid size and gathered into
the token layout with one ``index_select``::

    images      (3, 32, 48)   (3, 16, 16)          patch 16
    grids       (2, 3)        (1, 1)
    pos embed   grid (D, gh, gw) resized to (D, 2, 3) and (D, 1, 1), rows (6, D) | (1, D)
    offsets     [0, 6, 7]     (the tokens' offsets)

* :func:`interpolate_pos_embed`: a learned ``(D, gh, gw)`` grid resized to every image's
  patch grid (bilinear with antialias by default, as timm's NaFlex ViT does), with
  gradients into the grid;
* :func:`factorized_pos_embed`: a row table plus a column table (looked up, or resized to
  every grid);
* :func:`rope_2d` / :func:`apply_rope_2d`: axial 2-D rotary positions from
  :func:`padless.patch_grid` (half of each head's dims rotate with the token's row, half
  with its column);
* :func:`drop_tokens`: keep a fraction of every image's tokens (NaViT-style), packed,
  deterministic given a generator, at least one token per non-empty image;
  :func:`take_tokens` drops coordinates or positions the same way.

>>> images = padless.from_list([torch.randn(3, 32, 48), torch.randn(3, 16, 16)])
>>> tokens = padless.patchify(images, 16) @ w_embed           # (N_i, D)
>>> x = tokens + interpolate_pos_embed(pos_grid, images, 16)  # pos_grid: (D, 7, 7) parameter
>>> x, kept = drop_tokens(x, 0.5, generator=torch.Generator().manual_seed(0))
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from padless.ops.vision.patchify import _check_images, _pair, _patch_rows
from padless.ops.common.dry_run import model_step, traceless
from padless.ops.common.host import from_host_structure, host_structure
from padless.ops.vision.compiled import AxisMap, prepare_images_for_compile
from padless.ops.common.structure import RAGGED, STATIC, keep_all, restructure
from padless.tensor import layout
from padless.tensor.autograd import values_of
from padless.tensor.core import NestedTensor, _fmt_shape
from padless.tensor.errors import StructureError

__all__ = [
    "AxisMap", "apply_rope_2d", "drop_tokens", "factorized_pos_embed", "grid_sizes", "interpolate_pos_embed",
    "plan_recipe", "prepare_for_compile", "rope_2d", "take_tokens",
]

Patch = int | Sequence[int]


def grid_sizes(images: NestedTensor, patch: Patch) -> Tensor:
    """Every image's patch grid ``(h_i, w_i)`` as a CPU int64 ``(B, 2)`` tensor (host metadata,
    no sync). Sides must be multiples of the patch, as for :func:`padless.patchify`."""
    return _grid("grid_sizes", images, patch)[0]


def prepare_for_compile(
    images: NestedTensor,
    strides: Sequence[int | tuple[int, int]] = (2, 4, 8, 16, 32),
    levels: Sequence[AxisMap | tuple[AxisMap, AxisMap]] = (),
    patch: Patch | Sequence[Patch] | None = None,
) -> NestedTensor:
    """Optional since any geometry compiles without preparation: carry ``images``' host sides
    into compiled graphs now (every image batch with host sizes does so by itself when it enters
    a graph; a batch built on a device without host sizes reads them here, once, instead of at
    its first spatial op inside the graph).

    ``strides`` and ``levels`` are accepted for compatibility and only checked (see
    :mod:`padless.ops.vision.compiled`: output sizes are computed in the graph from the host
    sides, row counts are unbacked symbols). ``patch`` (``p``, ``(ph, pw)`` or a list of them)
    carries the token envelope ``max_i N_i`` that :func:`padless.patchify` needs under compile
    (a size of the structure, which a symbol read from data cannot be). Returns ``images``.

    >>> x = prepare_for_compile(padless.from_list([torch.randn(3, 40, 56), torch.randn(3, 33, 17)]))
    >>> logits = torch.compile(resnet, fullgraph=True)(x)
    """
    from padless.ops.vision.traced import prepare_patches

    prepare_images_for_compile(images, strides, levels)
    if patch is not None:
        many = isinstance(patch, (list, tuple)) and any(isinstance(p, (list, tuple)) for p in patch) or isinstance(patch, list)
        prepare_patches(images, [_pair("prepare_for_compile", "patch", p) for p in (patch if many else [patch])])
    return images


def _grid(op: str, images: NestedTensor, patch: Patch) -> tuple[Tensor, Tensor, Tensor]:
    """Host grid sizes ``(B, 2)``, token offsets ``(B+1,)`` and token ``(row, col)`` ``(N, 2)``."""
    _check_images(op, images)
    kh, kw = _pair(op, "patch", patch)
    _, grid, tok_off, coords = _patch_rows(op, images, kh, kw, True)
    return grid, tok_off, coords


def _tokens_like(op: str, values: Tensor, images: NestedTensor, grid: Tensor, tok_off: Tensor) -> NestedTensor:
    """``values`` ``(N, D)`` as a NestedTensor with the token structure of ``patchify(images)``."""
    sizes = torch.stack([grid.prod(1), torch.full_like(grid[:, 0], values.shape[1])], 1)
    return from_host_structure(values, sizes, (0,), images, tok_off)


def _distinct(keys: list[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """Distinct keys in order of first appearance, and each entry's position among them."""
    seen: dict[tuple[int, ...], int] = {}
    pos = [seen.setdefault(k, len(seen)) for k in keys]
    return list(seen), pos


def interpolate_pos_embed(
    pos: Tensor,
    images: NestedTensor,
    patch: Patch,
    *,
    mode: str = "bilinear",
    antialias: bool = True,
    align_corners: bool | None = False,
    ar_preserving: bool = False,
) -> NestedTensor:
    """A learned position grid resized to every image's patch grid, packed like its tokens.

    ``pos`` is ``(D, gh, gw)`` or ``(1, D, gh, gw)``. Token ``(r, c)`` of image i gets
    ``F.interpolate(pos, size=(h_i, w_i), mode=mode, antialias=antialias)[..., r, c]``;
    with ``ar_preserving`` the grid is resized to ``(L, L)``, ``L = max(h_i, w_i)``, and
    cropped to ``(h_i, w_i)``, so every image sees the grid at one scale. One
    ``F.interpolate`` per distinct grid size; gradients flow into ``pos``. Returns a
    NestedTensor ``(N_i, D)`` with the token structure of ``padless.patchify(images, patch)``.
    """
    op = "interpolate_pos_embed"
    if pos.dim() == 4 and pos.shape[0] == 1:
        pos = pos[0]
    if isinstance(pos, NestedTensor) or pos.dim() != 3:
        raise ValueError(f"{op}(): pos must be a dense (D, gh, gw) or (1, D, gh, gw) grid, got shape {tuple(pos.shape)}")
    grid, tok_off, _ = _grid(op, images, patch)
    sizes, which = _distinct([tuple(g) for g in grid.tolist()])
    pieces, base = [], [0]
    for h, w in sizes:
        if h * w == 0:
            pieces.append(pos.new_zeros(0, pos.shape[0]))
        else:
            target = (max(h, w),) * 2 if ar_preserving else (h, w)
            out = F.interpolate(pos[None], size=target, mode=mode, antialias=antialias, align_corners=align_corners)[0]
            pieces.append(out[:, :h, :w].flatten(1).t())
        base.append(base[-1] + h * w)
    idx = _gather_index(grid, tok_off, which, base)
    table = torch.cat(pieces, 0)
    return _tokens_like(op, table.index_select(0, idx.to(table.device, non_blocking=True)), images, grid, tok_off)


def _gather_index(grid: Tensor, tok_off: Tensor, which: list[int], base: list[int]) -> Tensor:
    """Token t of image i reads row ``base[which[i]] + t`` of the table of distinct grids."""
    n = int(tok_off[-1])
    sid = layout.row_sample_ids(tok_off, n)
    start = torch.tensor(base, dtype=torch.int64)[torch.tensor(which, dtype=torch.int64)] if which else torch.zeros(0, dtype=torch.int64)
    return start[sid] + torch.arange(n) - tok_off[:-1][sid]


def factorized_pos_embed(
    row: Tensor,
    col: Tensor,
    images: NestedTensor,
    patch: Patch,
    *,
    mode: str | None = None,
    antialias: bool = True,
) -> NestedTensor:
    """Factorised positions: token ``(r, c)`` gets ``row[r] + col[c]``, packed like the tokens.

    ``row`` is ``(gh, D)`` and ``col`` is ``(gw, D)``. With ``mode=None`` the tables are looked
    up (an image whose grid is larger than a table raises, naming it); with a 1-d mode
    (``"linear"``, ``"nearest"``, ...) each table is resized to every image's grid height or
    width first (one ``F.interpolate`` per distinct extent, ``antialias`` as given).
    """
    op = "factorized_pos_embed"
    if row.dim() != 2 or col.dim() != 2 or row.shape[1] != col.shape[1]:
        raise ValueError(f"{op}(): row must be (gh, D) and col (gw, D) with one D, got {tuple(row.shape)} and {tuple(col.shape)}")
    grid, tok_off, coords = _grid(op, images, patch)
    r_idx, c_idx = coords[:, 0], coords[:, 1]
    if mode is None:
        bad = ((grid[:, 0] > row.shape[0]) | (grid[:, 1] > col.shape[0])).nonzero()
        if len(bad):
            i = int(bad[0, 0])
            raise ValueError(
                f"{op}(): image {i} has a patch grid of {tuple(grid[i].tolist())}, larger than the tables "
                f"({row.shape[0]} rows, {col.shape[0]} columns); pass mode='linear' to resize the tables to every grid"
            )
        rows_t, cols_t = row, col
    else:
        sid = layout.row_sample_ids(tok_off, int(tok_off[-1]))
        rows_t, r_base = _resize_1d(row, grid[:, 0].tolist(), mode, antialias)
        cols_t, c_base = _resize_1d(col, grid[:, 1].tolist(), mode, antialias)
        r_idx = r_base[sid] + r_idx
        c_idx = c_base[sid] + c_idx
    dev = rows_t.device
    out = rows_t.index_select(0, r_idx.to(dev, non_blocking=True)) + cols_t.index_select(0, c_idx.to(dev, non_blocking=True))
    return _tokens_like(op, out, images, grid, tok_off)


def _resize_1d(table: Tensor, extents: list[int], mode: str, antialias: bool) -> tuple[Tensor, Tensor]:
    """``table`` ``(g, D)`` resized to every distinct extent, stacked; and each image's first row."""
    kinds, which = _distinct([(e,) for e in extents])
    pieces, base = [], [0]
    for (e,) in kinds:
        if e == 0:
            pieces.append(table.new_zeros(0, table.shape[1]))
        else:
            aa = antialias and mode in ("bilinear", "bicubic", "linear")
            if mode == "linear":  # torch antialiases 2-d modes only: a 1-d linear resize is bilinear on (g, 1)
                out = F.interpolate(table.t()[None, :, :, None], size=(e, 1), mode="bilinear", antialias=aa, align_corners=False)[0, :, :, 0]
            else:
                out = F.interpolate(table.t()[None], size=e, mode=mode)[0]
            pieces.append(out.t())
        base.append(base[-1] + e)
    start = torch.tensor(base, dtype=torch.int64)[torch.tensor(which, dtype=torch.int64)]
    return torch.cat(pieces, 0), start


def rope_2d(coords: NestedTensor, dim: int, *, theta: float = 100.0, dtype: torch.dtype = torch.float32) -> tuple[NestedTensor, NestedTensor]:
    """Axial 2-D rotary angles of every token: ``(cos, sin)``, each ``(N_i, dim)`` with the
    structure of ``coords``.

    ``coords`` is the ``(N_i, 2)`` integer ``(row, col)`` of every token, as
    :func:`padless.patch_grid` gives it (or the kept coordinates after :func:`drop_tokens`,
    via :func:`take_tokens`). The first ``dim / 2`` dims rotate with the row, the last
    ``dim / 2`` with the column, at frequencies ``theta ** (-2k / (dim / 2))`` for
    ``k < dim / 4``, in the "rotate half" pairing (dim j pairs with dim ``j + dim / 4`` inside
    each half). ``dim`` must be a multiple of 4. Computed on ``coords``' device, no sync.
    Use :func:`apply_rope_2d` on queries and keys.
    """
    op = "rope_2d"
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 4:
        raise ValueError(f"{op}(): dim must be a positive multiple of 4 (two axes, each rotating pairs), got {dim!r}")
    if not isinstance(coords, NestedTensor) or coords._ragged != (0,) or coords._values.shape[1:] != (2,):
        raise TypeError(f"{op}(): coords must be a NestedTensor (N_i, 2) of token (row, col), as padless.patch_grid gives")
    q = dim // 4
    c = coords._values
    freqs = theta ** (-torch.arange(q, dtype=torch.float64, device=c.device) / q)
    ang_r = c[:, :1].double() * freqs  # (N, q)
    ang_c = c[:, 1:].double() * freqs
    ang = torch.cat([ang_r, ang_r, ang_c, ang_c], 1)  # rotate-half pairs within each axis half
    dims = [(RAGGED, 0), (STATIC, dim)]
    return restructure(coords, ang.cos().to(dtype), dims), restructure(coords, ang.sin().to(dtype), dims)


def apply_rope_2d(x: NestedTensor, cos: NestedTensor, sin: NestedTensor) -> NestedTensor:
    """Rotate ``x`` ``(N_i, ..., dim)`` (e.g. ``(N_i, heads, dim)`` queries) by :func:`rope_2d`'s
    angles: within each half of the last dim, ``x * cos + rotate_half(x) * sin``."""
    op = "apply_rope_2d"
    if not all(isinstance(t, NestedTensor) for t in (x, cos, sin)) or x._ragged != (0,):
        raise TypeError(f"{op}(): x, cos and sin must be NestedTensors of tokens (N_i, ...) ragged along dim 1")
    xs, cs = host_structure(x, op)[0], host_structure(cos, op)[0]
    if xs.shape[0] != cs.shape[0] or not torch.equal(xs[:, 0], cs[:, 0]):
        i = int((xs[:, 0] != cs[:, 0]).nonzero()[0, 0]) if xs.shape[0] == cs.shape[0] else -1
        where = f"sample {i} has {_fmt_shape(xs[i].tolist())}, cos has {_fmt_shape(cs[i].tolist())}" if i >= 0 else f"{xs.shape[0]} vs {cs.shape[0]} samples"
        raise StructureError(f"{op}(): x and cos must have the same tokens: {where}")
    v = values_of(x)
    d = cos._values.shape[-1]
    if v.shape[-1] != d:
        raise ValueError(f"{op}(): the last dim of x is {v.shape[-1]}, the rotary angles cover {d}")
    shape = (v.shape[0],) + (1,) * (v.dim() - 2) + (d,)
    c, s = values_of(cos).reshape(shape), values_of(sin).reshape(shape)
    h = d // 4
    parts = v.unflatten(-1, (2, 2, h))  # (axis, half of the pair, k)
    rotated = torch.stack([-parts[..., 1, :], parts[..., 0, :]], -2).flatten(-3)
    out = v * c + rotated * s
    return restructure(x, out, keep_all(x))


def take_tokens(x: NestedTensor, index: NestedTensor) -> NestedTensor:
    """Rows ``index[i]`` of every sample i of ``x`` ``(N_i, ...)``: ``index`` is an int64
    NestedTensor ``(K_i,)`` of sample-local indices (as :func:`drop_tokens` returns), and the
    result is ``(K_i, ...)``. Gathers on the device with the host offsets of ``index``, no sync.
    Use it to drop positions or coordinates the way the tokens were dropped."""
    op = "take_tokens"
    if not isinstance(x, NestedTensor) or not isinstance(index, NestedTensor) or x._ragged != (0,) or index._ragged != (0,):
        raise TypeError(f"{op}(): x (N_i, ...) and index (K_i,) must be NestedTensors ragged along dim 1")
    if x.batch_size != index.batch_size:
        raise StructureError(f"{op}(): x has {x.batch_size} samples, index has {index.batch_size}")
    io = host_structure(index, op)[1]
    hs = host_structure(x, op)[0].clone()
    sid = layout.row_sample_ids(io, int(io[-1])).to(x._offsets.device, non_blocking=True)
    n = (x._offsets[1:] - x._offsets[:-1]).index_select(0, sid)
    bad = (index._values < 0) | (index._values >= n)
    if bad.device.type == "cpu":  # host data: name the sample; on a device, check without a sync
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0])
            i = int(sid[j])
            raise IndexError(f"{op}(): index {int(index._values[j])} of sample {i} is out of range for its {int(hs[i, 0])} tokens")
    else:
        torch._assert_async(~bad.any(), f"{op}(): a sample-local index is out of range for its sample")
    rows = x._offsets.index_select(0, sid) + index._values
    vals = values_of(x).index_select(0, rows)
    hs[:, 0] = io[1:] - io[:-1]
    return from_host_structure(vals, hs, (0,), x, io)


def drop_tokens(
    tokens: NestedTensor, keep: float, *, generator: torch.Generator | None = None
) -> tuple[NestedTensor, NestedTensor]:
    """Keep a random ``keep`` fraction of every image's tokens (NaViT-style token dropping).

    Image i keeps ``k_i = max(1, round(keep * N_i))`` of its ``N_i`` tokens (none if it has
    none), chosen uniformly without replacement by a host draw from ``generator`` (the same
    generator state gives the same choice), in their original order. Returns the kept tokens
    ``(k_i, ...)``, packed, and their sample-local indices, an int64 NestedTensor ``(k_i,)``
    (to drop other per-token tensors the same way, e.g. ``torch.gather`` or positions).
    Gradients flow to the kept tokens.
    """
    op = "drop_tokens"
    if not isinstance(tokens, NestedTensor) or tokens._ragged != (0,):
        raise TypeError(f"{op}(): tokens must be a NestedTensor (N_i, ...) ragged along dim 1")
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep <= 1:
        raise ValueError(f"{op}(): keep must be a fraction in (0, 1], got {keep!r}")
    hs, ho = host_structure(tokens, op)
    n = hs[:, 0]
    k = torch.where(n > 0, (n.double() * keep + 0.5).floor().long().clamp(min=1), torch.zeros_like(n)).minimum(n)
    total = int(ho[-1])
    sid = layout.row_sample_ids(ho, total)
    score = torch.rand(total, generator=generator, dtype=torch.float64) + 2.0 * sid.double()
    order = score.argsort()  # segment by segment, random order inside each
    rank = torch.empty_like(order)
    rank[order] = torch.arange(total) - ho[:-1][sid[order]]
    kept = (rank < k[sid]).nonzero().flatten()  # ascending: the original order
    local = kept - ho[:-1][sid[kept]]
    out_hs = hs.clone()
    out_hs[:, 0] = k
    out_ho = layout.offsets_from_counts(k)
    vals = values_of(tokens).index_select(0, kept.to(tokens.device, non_blocking=True))
    index = from_host_structure(local.to(tokens.device, non_blocking=True), k[:, None], (0,), tokens, out_ho)
    return from_host_structure(vals, out_hs, (0,), tokens, out_ho), index


def plan_recipe(model: "torch.nn.Module | Callable[[NestedTensor], Any]", example: NestedTensor, *, backward: bool = True) -> Any:
    """The spatial plans of a whole network, for ``Field(spatial_plan=recipe)``: the Collator then
    builds every layer's plans (each stage's convolutions, pools, strided projections, adaptive
    pooling, nearest upsampling by powers of two) for every batch in its workers, and the first step
    of a new batch builds none.

    Learned from one step of ``model`` on ``example`` (images ``(C, H_i, W_i)`` ragged along
    ``(1, 2)``, or sequences ``(C, L_i)``), forward and, with ``backward``, backward (the indices
    only a backward reads). The step leaves no trace: parameter gradients, buffers (batch-norm
    running statistics) and the random number generator's state are restored. Record on sizes unlike the training batches' (a few
    images of different sizes): plans are cached by content, so anything built before on the
    same sizes is recorded too. A batch whose geometry differs from the recipe stays correct;
    what the recipe did not build is built on first use, as without a recipe.

    >>> recipe = padless.vision.plan_recipe(model, padless.from_list([torch.randn(3, 40, 56), torch.randn(3, 23, 31)]))
    >>> collator = padless.Collator({"image": padless.Field(ragged=(1, 2), spatial_plan=recipe)})
    """
    from padless.ops.vision.recipe import record

    if not isinstance(example, NestedTensor):
        raise TypeError(f"plan_recipe(): example must be a NestedTensor of images, got {type(example).__name__}")
    # dropout draws from a forked generator: the user's stream is left as it was
    return traceless(model, example._values.device, lambda: record(example, model_step(model, backward, example)))
