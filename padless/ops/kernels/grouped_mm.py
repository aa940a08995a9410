"""Grouped matmul: one launch for per-sample contractions of NestedTensors.

``C_i[h] = A_i[h] @ B_i[h]`` for every sample ``i`` and static batch index ``h``,
where each sample's operands are strided views of the packed ``values`` buffers.
A descriptor table (one row per sample, built from host metadata) gives the
extents ``M_i, N_i, K_i`` and the element offset and strides of ``A``, ``B`` and
``C``; the grid is ``(B * H, tiles of (max M) x (max N))`` from host maxima. This
covers ``q @ k.transpose(-1, -2)`` giving ``(H, Q_i, K_i)``, ``attn @ v``, and the
triangle einsums ``bikc,bjkc->bijc`` / ``bkic,bkjc->bijc`` (``h`` = the channel).
Backward is two more grouped matmuls on permuted descriptors
(``dA = dC @ B^T``, ``dB = A^T @ dC``). The torch **twin** is the per-sample loop
of dense matmuls (:func:`padless.ops.pairs.contract.per_sample`).

Descriptor columns::

    0 M  1 N  2 K  3 a_off 4 a_sm 5 a_sk 6 a_sh  7 b_off 8 b_sk 9 b_sn 10 b_sh  11 c_off 12 c_sm 13 c_sn 14 c_sh
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

import torch
from torch import Tensor

from padless.ops.kernels import dispatch

FAMILY = "grouped_mm"
tl: Any = None
# dA = dC @ B^T and dB = A^T @ dC as column permutations of the descriptor
_DA = [0, 2, 1, 11, 12, 13, 14, 7, 9, 8, 10, 3, 4, 5, 6]
_DB = [2, 1, 0, 3, 5, 4, 6, 11, 12, 13, 14, 7, 8, 9, 10]


def _grouped_mm_kernel(a_ptr, b_ptr, c_ptr, desc_ptr, H, TILES_N,
                       FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    i = pid // H
    h = pid % H
    t = tl.program_id(1)
    tm = t // TILES_N
    tn = t % TILES_N
    d = desc_ptr + i * 15
    M = tl.load(d + 0)
    N = tl.load(d + 1)
    K = tl.load(d + 2)
    if tm * BLOCK_M < M and tn * BLOCK_N < N:
        a_base = tl.load(d + 3) + h * tl.load(d + 6)
        a_sm = tl.load(d + 4)
        a_sk = tl.load(d + 5)
        b_base = tl.load(d + 7) + h * tl.load(d + 10)
        b_sk = tl.load(d + 8)
        b_sn = tl.load(d + 9)
        c_base = tl.load(d + 11) + h * tl.load(d + 14)
        c_sm = tl.load(d + 12)
        c_sn = tl.load(d + 13)
        rm = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(a_ptr + a_base + rm[:, None] * a_sm + kk[None, :] * a_sk,
                        mask=(rm < M)[:, None] & (kk < K)[None, :], other=0.0)
            b = tl.load(b_ptr + b_base + kk[:, None] * b_sk + rn[None, :] * b_sn,
                        mask=(kk < K)[:, None] & (rn < N)[None, :], other=0.0)
            if FP32:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        tl.store(c_ptr + c_base + rm[:, None] * c_sm + rn[None, :] * c_sn, acc.to(c_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])


def _build(triton: Any, tl_mod: Any) -> types.SimpleNamespace:
    global tl
    tl = tl_mod
    return types.SimpleNamespace(mm=triton.jit(_grouped_mm_kernel))


kernels = dispatch.jit_kernels(_build)
BLOCK = 32


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """float32 inputs multiply in IEEE fp32 (not tf32), to match the twin; the interpreter's
    numpy ``dot`` has no bfloat16, so there bf16 tiles are widened to fp32 too."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and dispatch.interpreting())


def _launch(a: Tensor, b: Tensor, desc: Tensor, h: int, max_m: int, max_n: int, out_numel: int) -> Tensor:
    c = a.new_zeros(out_numel)  # elements outside every sample (none for packed outputs) stay zero
    bsz = desc.shape[0]
    if bsz and h and max_m and max_n:
        tiles_n = (max_n + BLOCK - 1) // BLOCK
        grid = (bsz * h, ((max_m + BLOCK - 1) // BLOCK) * tiles_n)
        dispatch.launch(kernels().mm, grid, a, b, c, desc, h, tiles_n, FP32=_dot_in_fp32(a.dtype),
                        BLOCK_M=BLOCK, BLOCK_N=BLOCK, BLOCK_K=BLOCK)
    return c


@torch.library.triton_op("padless::grouped_mm", mutates_args=())
def grouped_mm_op(a: Tensor, b: Tensor, desc: Tensor, h: int, max_m: int, max_n: int, max_k: int,
                  out_numel: int) -> Tensor:
    """Flat buffers ``a``, ``b`` -> flat ``c`` (``out_numel`` elements) per the descriptor table."""
    return _launch(a, b, desc, h, max_m, max_n, out_numel)


@grouped_mm_op.register_fake
def _grouped_mm_fake(a, b, desc, h, max_m, max_n, max_k, out_numel):
    return a.new_empty(out_numel)


def _setup(ctx, inputs, output):
    a, b, desc, h, max_m, max_n, max_k, out_numel = inputs
    ctx.save_for_backward(a, b, desc)
    ctx.dims = (h, max_m, max_n, max_k)


def _backward(ctx, gc):
    a, b, desc = ctx.saved_tensors
    h, max_m, max_n, max_k = ctx.dims
    gc = gc.contiguous()
    da = grouped_mm_op(gc, b, desc[:, _DA].contiguous(), h, max_m, max_k, max_n, a.numel())
    db = grouped_mm_op(a, gc, desc[:, _DB].contiguous(), h, max_k, max_n, max_m, b.numel())
    return da, db, None, None, None, None, None, None


grouped_mm_op.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------------------- descriptors


def sample_strides(host_sizes: Tensor, ragged: tuple[int, ...], static_shape: tuple[int, ...]) -> Tensor:
    """Element stride of every sample dim, per sample ``(B, D)``, for contiguous ``values``.

    Rows are laid out over the ragged dims in storage order; each row holds the static
    dims (in storage order) contiguously.
    """
    b, ndim = host_sizes.shape
    f = math.prod(static_shape)
    strides = torch.zeros(b, ndim, dtype=torch.int64)
    run = torch.full((b,), f, dtype=torch.int64)
    for d in reversed(ragged):
        strides[:, d] = run
        run = run * host_sizes[:, d]
    static = [d for d in range(ndim) if d not in ragged]
    s = 1
    for d, n in zip(reversed(static), reversed(static_shape)):
        strides[:, d] = s
        s *= n
    return strides


@dataclasses.dataclass(frozen=True)
class Operand:
    """One side of a grouped contraction: host sizes/strides/row offsets, and its letters."""

    sizes: Tensor  # (B, D) host
    strides: Tensor  # (B, D) host, elements
    elem_off: Tensor  # (B,) host, element offset of each sample
    letters: str


def operand(nt: Any, letters: str) -> Operand:
    """Describe a NestedTensor (sample dims named by ``letters``) for :func:`build_desc`."""
    hs = nt.host_sizes()
    f = math.prod(nt._values.shape[1:])
    off = nt.host_offsets()[:-1] * f
    return Operand(hs, sample_strides(hs, nt._ragged, tuple(nt._values.shape[1:])), off, letters)


def build_desc(a: Operand, b: Operand, c: Operand, m: str, n: str, k: str, h: str | None) -> Tensor:
    """Host descriptor table ``(B, 15)`` for ``c[m, n] = sum_k a[m, k] * b[k, n]`` (per ``h``)."""

    def ext(o: Operand, letter: str) -> Tensor:
        return o.sizes[:, o.letters.index(letter)]

    def st(o: Operand, letter: str | None) -> Tensor:
        if letter is None or letter not in o.letters:
            return torch.zeros(o.sizes.shape[0], dtype=torch.int64)
        return o.strides[:, o.letters.index(letter)]

    cols = [ext(a, m), ext(b, n), ext(a, k),
            a.elem_off, st(a, m), st(a, k), st(a, h),
            b.elem_off, st(b, k), st(b, n), st(b, h),
            c.elem_off, st(c, m), st(c, n), st(c, h)]
    return torch.stack(cols, 1)


def twin_grouped_mm(a: Tensor, b: Tensor, desc: Tensor, h: int, out_numel: int) -> Tensor:
    """The torch twin on the same flat buffers: one dense matmul per sample (a loop)."""
    c = a.new_zeros(out_numel)
    rows = desc.tolist()  # host descriptor (the twin runs where the loop runs: on the host's side)
    pieces = []
    for M, N, K, ao, asm, ask, ash, bo, bsk, bsn, bsh, co, csm, csn, csh in rows:
        if M == 0 or N == 0:
            continue
        av = a.as_strided((h, M, K), (ash, asm, ask), ao)
        bv = b.as_strided((h, K, N), (bsh, bsk, bsn), bo)
        idx = torch.arange(h).view(h, 1, 1) * csh + torch.arange(M).view(1, M, 1) * csm + torch.arange(N).view(1, 1, N) * csn + co
        pieces.append((idx.reshape(-1).to(a.device), torch.matmul(av, bv).reshape(-1)))
    if pieces:
        c = c.index_put((torch.cat([p[0] for p in pieces]),), torch.cat([p[1] for p in pieces]))
    return c


def grouped_mm(a: Tensor, b: Tensor, desc_host: Tensor, h: int, out_numel: int) -> Tensor:
    """``c`` (flat, ``out_numel``) from flat contiguous ``a``, ``b`` and a host descriptor table."""

    def unsupported() -> str | None:
        if not a.is_floating_point() or a.dtype != b.dtype:
            return f"dtypes {a.dtype}/{b.dtype} (the kernel multiplies one floating dtype)"
        return None

    if not dispatch.use_kernel(FAMILY, a, unsupported=unsupported):
        return twin_grouped_mm(a, b, desc_host, h, out_numel)
    b_ = desc_host.shape[0]
    mx = desc_host[:, :3].amax(0).tolist() if b_ else [0, 0, 0]
    desc = desc_host.to(a.device, non_blocking=True)
    return grouped_mm_op(a, b, desc, h, int(mx[0]), int(mx[1]), int(mx[2]), out_numel)
