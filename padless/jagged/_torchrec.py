"""TorchRec's module, loaded on demand, and the constructor arguments the jagged types share with it.

padless' ``JaggedTensor``/``KeyedJaggedTensor``/``KeyedTensor`` have TorchRec's accessors,
so one function per type reads the constructor arguments from an object of either library:
``to_torchrec()`` passes them to TorchRec's class, ``from_torchrec()`` to padless' own. Nothing
here knows the padless classes (they import this module; ``padless.jagged.interop`` sits above
them).
"""

from __future__ import annotations

from typing import Any


def module() -> Any:
    """``torchrec.sparse.jagged_tensor``, or an ImportError that says padless works without it."""
    try:
        import torchrec.sparse.jagged_tensor as trj
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"padless.jagged: converting to or from TorchRec needs the torchrec package ({e}); "
            "padless' own JaggedTensor/KeyedJaggedTensor/KeyedTensor work without it"
        ) from e
    return trj


def jt_kwargs(jt: Any) -> dict[str, Any]:
    """Constructor arguments of a JaggedTensor (padless' or TorchRec's)."""
    return dict(
        values=jt.values(), weights=jt.weights_or_none(), lengths=jt.lengths_or_none(), offsets=jt.offsets_or_none()
    )


def kjt_kwargs(kjt: Any) -> dict[str, Any]:
    """Constructor arguments of a KeyedJaggedTensor (padless' or TorchRec's): ``stride`` for a
    fixed batch, ``stride_per_key_per_rank`` for a variable one, and the ``inverse_indices`` a
    variable-batch (VBE) KJT carries (the same tuple, not a copy)."""
    variable = kjt.variable_stride_per_key()
    return dict(
        keys=kjt.keys(),
        values=kjt.values(),
        weights=kjt.weights_or_none(),
        lengths=kjt.lengths_or_none(),
        offsets=kjt.offsets_or_none(),
        stride=None if variable else kjt.stride(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank() if variable else None,
        length_per_key=kjt.length_per_key_or_none(),
        offset_per_key=kjt.offset_per_key_or_none(),
        inverse_indices=kjt.inverse_indices_or_none(),
    )


def kt_kwargs(kt: Any) -> dict[str, Any]:
    """Constructor arguments of a KeyedTensor (padless' or TorchRec's)."""
    return dict(keys=kt.keys(), length_per_key=kt.length_per_key(), values=kt.values(), key_dim=kt.key_dim())
