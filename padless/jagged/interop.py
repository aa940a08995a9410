"""Conversion to and from TorchRec's types, when ``torchrec`` is importable (never required).

The same conversions as the types' ``to_torchrec()``/``from_torchrec()`` methods, as
functions. This module sits above the three types; what they share with TorchRec (its
module, loaded on demand, and the constructor arguments) is ``padless.jagged._torchrec``.
"""

from __future__ import annotations

from typing import Any

from padless.jagged.jagged_tensor import JaggedTensor
from padless.jagged.keyed_jagged import KeyedJaggedTensor
from padless.jagged.keyed_tensor import KeyedTensor


def jt_to_torchrec(jt: JaggedTensor) -> Any:
    return jt.to_torchrec()


def jt_from_torchrec(jt: Any) -> JaggedTensor:
    return JaggedTensor.from_torchrec(jt)


def kjt_to_torchrec(kjt: KeyedJaggedTensor) -> Any:
    return kjt.to_torchrec()


def kjt_from_torchrec(kjt: Any) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_torchrec(kjt)


def kt_to_torchrec(kt: KeyedTensor) -> Any:
    return kt.to_torchrec()


def kt_from_torchrec(kt: Any) -> KeyedTensor:
    return KeyedTensor.from_torchrec(kt)
