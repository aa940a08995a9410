"""The shared reference harness: named sample variants and a per-sample checker.

Tests, examples and benchmarks build their inputs here so they share one
reference. The contract checked for every op ``f``::

    unbind(f(Z))[i] == f_ref(unbind(Z)[i])      values, structure, gradients

where, by default, ``f_ref(s) = f(s[None])[0]``: the same code run on a dense
batch of one sample.
"""

from padless.testing.variants import VARIANTS, Variant, make_batch, random_shapes, variant
from padless.testing.reference import assert_close_samples, check_op, check_samples, leaves
from padless.testing import bench

__all__ = [
    "VARIANTS",
    "Variant",
    "assert_close_samples",
    "bench",
    "check_op",
    "check_samples",
    "leaves",
    "make_batch",
    "random_shapes",
    "variant",
]
