"""Compare padless with torch's jagged-layout nested tensors (NJT): the same samples as a
padless NestedTensor and as an NJT, and a sample-by-sample comparison (used by the
``tests/test_nested_parity*`` files)."""

import torch

from padless import nested


def samples(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def pair(samples, requires_grad=False):
    """(padless NestedTensor, torch NJT) built from copies of ``samples``."""
    pl = nested.nested_tensor([s.clone() for s in samples], requires_grad=requires_grad)
    njt = torch.nested.nested_tensor([s.clone() for s in samples], layout=torch.jagged, requires_grad=requires_grad)
    return pl, njt


def same(pl, njt):
    """Equal sample by sample: shapes and values."""
    a, b = list(pl.unbind()), list(njt.unbind())
    if len(a) != len(b):
        raise AssertionError(f"padless has {len(a)} samples, the NJT {len(b)}")
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            raise AssertionError(f"sample {i}: padless shape {tuple(x.shape)}, NJT shape {tuple(y.shape)}")
        torch.testing.assert_close(x, y, msg=lambda m, i=i: f"sample {i}: {m}")
