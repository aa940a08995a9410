"""Conversion to and from TorchRec's types, when ``torchrec`` is importable (never required)."""

from __future__ import annotations

from typing import Any

from padless.jagged.jagged_tensor import JaggedTensor
from padless.jagged.keyed_jagged import KeyedJaggedTensor
from padless.jagged.keyed_tensor import KeyedTensor


def _torchrec() -> Any:
    try:
        import torchrec.sparse.jagged_tensor as trj
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"padless.jagged: converting to or from TorchRec needs the torchrec package ({e}); "
            "padless' own JaggedTensor/KeyedJaggedTensor/KeyedTensor work without it"
        ) from e
    return trj


def jt_to_torchrec(jt: JaggedTensor) -> Any:
    return _torchrec().JaggedTensor(
        values=jt.values(), weights=jt.weights_or_none(), lengths=jt.lengths_or_none(), offsets=jt.offsets_or_none()
    )


def jt_from_torchrec(jt: Any) -> JaggedTensor:
    return JaggedTensor(
        values=jt.values(), weights=jt.weights_or_none(), lengths=jt.lengths_or_none(), offsets=jt.offsets_or_none()
    )


def kjt_to_torchrec(kjt: KeyedJaggedTensor) -> Any:
    variable = kjt.variable_stride_per_key()
    return _torchrec().KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values(),
        weights=kjt.weights_or_none(),
        lengths=kjt.lengths_or_none(),
        offsets=kjt.offsets_or_none(),
        stride=None if variable else kjt.stride(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank() if variable else None,
        length_per_key=kjt.length_per_key_or_none(),
        offset_per_key=kjt.offset_per_key_or_none(),
    )


def kjt_from_torchrec(kjt: Any) -> KeyedJaggedTensor:
    variable = kjt.variable_stride_per_key()
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values(),
        weights=kjt.weights_or_none(),
        lengths=kjt.lengths_or_none(),
        offsets=kjt.offsets_or_none(),
        stride=None if variable else kjt.stride(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank() if variable else None,
        length_per_key=kjt.length_per_key_or_none(),
        offset_per_key=kjt.offset_per_key_or_none(),
    )


def kt_to_torchrec(kt: KeyedTensor) -> Any:
    return _torchrec().KeyedTensor(
        keys=kt.keys(), length_per_key=kt.length_per_key(), values=kt.values(), key_dim=kt.key_dim()
    )


def kt_from_torchrec(kt: Any) -> KeyedTensor:
    return KeyedTensor(keys=kt.keys(), length_per_key=kt.length_per_key(), values=kt.values(), key_dim=kt.key_dim())
