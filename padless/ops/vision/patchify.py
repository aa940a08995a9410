"""Images at their own resolution to patch tokens and back, and the patch path of ``F.conv2d``.

A batch of images ``(C, H_i, W_i)`` (ragged dims ``(1, 2)``) is stored as its pixels:
``values`` is ``(sum_i H_i W_i, C)``, row-major over ``(h, w)`` per image. Cutting it
into ``p x p`` patches is a permutation of those rows, computed once per batch on the
host metadata and cached. Layout, two images ``(C=1, 2, 4)`` and ``(C=1, 2, 2)``,
``patch=2``::

    image 0 pixels (rows)   a b c d        image 1   i j
                            e f g h                  k l
    patchify values         [a b e f] [c d g h] [i j k l]     (N_i, C*p*p) = (2, 4), (1, 4)
    offsets / sizes         [0, 2, 3]      [[2, 4], [1, 4]]
    patch_grid values       [0 0] [0 1] [0 0]                 (row, col) of every token

Tokens are row-major over the patch grid; features are ordered ``(C, p, p)``, like
``F.unfold`` and ``conv.weight.flatten(1)``, so for a kernel == stride convolution::

    F.conv2d(x, w, b, stride=p)  ==  patchify(x, p) @ w.flatten(1).T + b     (per sample)

which is how :mod:`padless.ops.vision.conv` runs kernel == stride convolutions.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from padless.ops.common.host import from_host_structure, host_structure
from padless.tensor import layout
from padless.tensor.autograd import values_of
from padless.tensor.core import NestedTensor, _fmt_shape, _is_traced
from padless.ops.vision.compiled import island
from padless.tensor.errors import StructureError

__all__ = ["patch_grid", "patchify", "unpatchify"]

Patch = int | Sequence[int]


def _pair(op: str, name: str, x: Patch) -> tuple[int, int]:
    t = (x, x) if isinstance(x, int) else tuple(x)
    if len(t) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in t):
        raise ValueError(f"{op}(): {name} must be a positive int or a pair of them, got {x!r}")
    return t  # type: ignore[return-value]


def _check_images(op: str, nt: NestedTensor) -> None:
    if not isinstance(nt, NestedTensor):
        raise TypeError(f"{op}(): expected a NestedTensor of images (C, H_i, W_i), got {type(nt).__name__}")
    if nt.sample_dim != 3 or nt._ragged != (1, 2):
        raise StructureError(
            f"{op}(): expected images (C, H_i, W_i) with ragged sample dims (1, 2) stored in that order, got samples "
            f"of rank {nt.sample_dim} with ragged sample dims stored as {nt._ragged} (envelope {tuple(nt.shape)})"
        )


def _patch_index(op: str, hs: Tensor, ho: Tensor, kh: int, kw: int, exact: bool) -> tuple[Tensor, ...]:
    """Host index math: pixel rows of every patch ``(N, kh*kw)`` (row-major in the patch),
    grid sizes ``(B, 2)``, token offsets ``(B+1,)`` and token ``(row, col)`` ``(N, 2)``.

    ``exact`` refuses images whose sides are not multiples of the patch; otherwise the
    remainder is dropped, as a convolution with kernel == stride does.
    """
    hw = hs[:, 1:]
    if exact:
        bad = ((hw[:, 0] % kh) | (hw[:, 1] % kw)).nonzero()
        if len(bad):
            i = int(bad[0, 0])
            raise StructureError(
                f"{op}(): sample {i} has size {_fmt_shape(hs[i].tolist())}; its height and width must be "
                f"multiples of the patch ({kh}, {kw}). Crop or resize it first."
            )
    grid = torch.stack([hw[:, 0] // kh, hw[:, 1] // kw], 1)
    tok_off = layout.offsets_from_counts(grid.prod(1))
    sid, (a, b) = layout.row_coords(grid, tok_off, (0, 1), int(tok_off[-1]))
    u = torch.arange(kh).repeat_interleave(kw)
    v = torch.arange(kw).repeat(kh)
    rows = ho[:-1][sid, None] + (a[:, None] * kh + u) * hw[sid, 1, None] + (b[:, None] * kw + v)
    return rows, grid, tok_off, torch.stack([a, b], 1)


def _patch_rows(op: str, nt: NestedTensor, kh: int, kw: int, exact: bool) -> tuple[Tensor, ...]:
    """:func:`_patch_index` of ``nt``'s images with the rows on the values' device; cached per batch."""
    key = ("patch_rows", kh, kw, exact, nt._values.device)
    hit = nt._meta.derived.get(key)
    if hit is not None:
        return hit
    hs, ho = host_structure(nt, op)
    rows, grid, tok_off, coords = _patch_index(op, hs, ho, kh, kw, exact)
    out = (rows.to(nt._values.device, non_blocking=True), grid, tok_off, coords)
    if not _is_traced(nt._values):
        nt._meta.derived[key] = out
    return out


def _tokens(op: str, nt: NestedTensor, kh: int, kw: int, exact: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Token values ``(N, C*kh*kw)``, host grid sizes and token offsets."""
    rows, grid, tok_off, _ = _patch_rows(op, nt, kh, kw, exact)
    vals = values_of(nt)
    c = vals.shape[1]
    n = rows.shape[0]
    if (kh, kw) == (1, 1):
        return vals, grid, tok_off
    tok = vals.index_select(0, rows.flatten()).view(n, kh * kw, c).transpose(1, 2).reshape(n, c * kh * kw)
    return tok, grid, tok_off


def patchify(images: NestedTensor, patch: Patch) -> NestedTensor:
    """Cut every image ``(C, H_i, W_i)`` into ``(H_i/p * W_i/p, C*p*p)`` patch tokens.

    ``patch`` is ``p`` or ``(ph, pw)``. Tokens are row-major over the patch grid (use
    :func:`patch_grid` for their ``(row, col)``); features are ordered ``(C, ph, pw)`` like
    ``conv.weight.flatten(1)``. The result is ragged along dim 1 (tokens). A side that is
    not a multiple of the patch raises, naming the sample. Differentiable; the row
    permutation is computed once per batch from host metadata and cached.

    >>> x = padless.from_list([torch.randn(3, 32, 48), torch.randn(3, 16, 16)])
    >>> patchify(x, 16).shape        # (B, max tokens, C*16*16)
    torch.Size([2, 6, 768])
    """
    _check_images("patchify", images)
    kh, kw = _pair("patchify", "patch", patch)
    if _is_traced(images._values):  # torch.compile: see padless.ops.vision.compiled
        from padless.ops.vision.traced import traced_patchify

        return traced_patchify(images, kh, kw)
    tok, grid, tok_off = _tokens("patchify", images, kh, kw, True)
    sizes = torch.stack([grid.prod(1), torch.full_like(grid[:, 0], tok.shape[1])], 1)
    return from_host_structure(tok, sizes, (0,), images, tok_off)


def patch_grid(images: NestedTensor, patch: Patch) -> NestedTensor:
    """The ``(row, col)`` of every token :func:`patchify` makes, on its image's patch grid.

    For 2-D position embeddings of a native-resolution ViT: token ``k`` of image ``i`` is
    the patch at ``(row, col)`` of that image's own ``(H_i // ph, W_i // pw)`` grid.

    Args:
        images: a NestedTensor of images ``(C, H_i, W_i)`` ragged along dims (1, 2), each
            side a multiple of the patch.
        patch: the patch size, an int or ``(ph, pw)``.

    Returns:
        An int64 NestedTensor ``(N_i, 2)`` with the token structure of ``patchify(images, patch)``
        (``N_i = (H_i // ph) * (W_i // pw)``), rows in the tokens' (row-major) order.

    Example:
        >>> import torch, padless
        >>> imgs = padless.from_list([torch.zeros(3, 4, 6), torch.zeros(3, 2, 2)])
        >>> grid = padless.patch_grid(imgs, 2)
        >>> [g.tolist() for g in grid.unbind()]
        [[[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]], [[0, 0]]]
    """
    _check_images("patch_grid", images)
    kh, kw = _pair("patch_grid", "patch", patch)
    _, grid, tok_off, coords = _patch_rows("patch_grid", images, kh, kw, True)
    sizes = torch.stack([grid.prod(1), torch.full_like(grid[:, 0], 2)], 1)
    return from_host_structure(coords.to(images.device, non_blocking=True), sizes, (0,), images, tok_off)


def unpatchify(tokens: NestedTensor, patch: Patch, image_sizes: Tensor | NestedTensor) -> NestedTensor:
    """Inverse of :func:`patchify`: tokens ``(N_i, C*ph*pw)`` back to images ``(C, H_i, W_i)``.

    Args:
        tokens: a NestedTensor ``(N_i, C*ph*pw)`` ragged along dim 1, as :func:`patchify`
            makes it (or a model's output of that layout).
        patch: the patch size, an int or ``(ph, pw)``.
        image_sizes: the image batch itself, or a CPU int tensor ``(B, 2)`` of ``(H_i, W_i)``.

    Returns:
        A NestedTensor of images ``(C, H_i, W_i)`` ragged along dims (1, 2).

    Example:
        >>> import torch, padless
        >>> imgs = padless.from_list([torch.randn(3, 4, 6), torch.randn(3, 2, 2)])
        >>> back = padless.unpatchify(padless.patchify(imgs, 2), 2, imgs)
        >>> all(torch.equal(a, b) for a, b in zip(back.unbind(), imgs.unbind()))
        True
    """
    kh, kw = _pair("unpatchify", "patch", patch)
    if not isinstance(tokens, NestedTensor) or tokens.sample_dim != 2 or tokens._ragged != (0,):
        raise StructureError("unpatchify(): tokens must be a NestedTensor (N_i, C*ph*pw) ragged along dim 1")
    feat = tokens._values.shape[1]
    if feat % (kh * kw):
        raise StructureError(f"unpatchify(): {feat} token features are not a multiple of the patch area {kh * kw}")
    c = feat // (kh * kw)
    if _is_traced(tokens._values):  # torch.compile: see padless.ops.vision.compiled
        from padless.ops.vision.traced import traced_unpatchify

        return traced_unpatchify(tokens, kh, kw, image_sizes)
    if isinstance(image_sizes, NestedTensor):
        hw = host_structure(image_sizes, "unpatchify")[0][:, -2:]
    else:
        hw = torch.as_tensor(image_sizes, dtype=torch.int64)
    if hw.device.type != "cpu" or hw.dim() != 2 or hw.shape != (tokens.batch_size, 2):
        raise ValueError(
            f"unpatchify(): image_sizes must be a CPU (B, 2) tensor of (H_i, W_i) with B = {tokens.batch_size}, "
            f"got shape {tuple(hw.shape)} on {hw.device}"
        )
    hs = torch.cat([torch.full_like(hw[:, :1], c), hw], 1)
    ths = host_structure(tokens, "unpatchify")[0]
    want = (hw[:, 0] // kh) * (hw[:, 1] // kw)
    bad = ((ths[:, 0] != want) | (hw[:, 0] % kh != 0) | (hw[:, 1] % kw != 0)).nonzero()
    if len(bad):
        i = int(bad[0, 0])
        raise StructureError(
            f"unpatchify(): sample {i} has {int(ths[i, 0])} tokens, but an image of size "
            f"{tuple(hw[i].tolist())} cut into ({kh}, {kw}) patches has {int(want[i])} (sides must be multiples)"
        )
    rows = _patch_index("unpatchify", hs, layout.offsets_from_counts(hw.prod(1)), kh, kw, True)[0]
    inv = torch.empty_like(rows.flatten())
    inv[rows.flatten()] = torch.arange(inv.shape[0], device=inv.device)
    n = rows.shape[0]
    px = values_of(tokens).reshape(n, c, kh * kw).transpose(1, 2).reshape(n * kh * kw, c)
    return from_host_structure(px.index_select(0, inv.to(px.device, non_blocking=True)), hs, (1, 2), tokens)


# Under torch.compile these two are graph calls, as torch ops on a NestedTensor are: dynamo
# runs them on fake tensors (their traced branch) instead of inlining their Python.
torch.compiler.allow_in_graph(patchify)
torch.compiler.allow_in_graph(unpatchify)


# The eager bodies that the compiled patch ops (padless.ops.vision.traced) run on real tensors.
@island("patchify")
def _patchify_body(nt: NestedTensor, tensors: list, spec: tuple) -> Tensor:
    return values_of(patchify(nt, spec))


@island("unpatchify")
def _unpatchify_body(nt: NestedTensor, tensors: list, spec: tuple) -> Tensor:
    return values_of(unpatchify(nt, spec, tensors[0]))  # the images' host sides (B, 2)

