"""Lazy imports of the optional packages behind the ``padless[loaders]`` extra."""

from __future__ import annotations

import importlib
from types import ModuleType

_PIP_NAMES = {"PIL": "pillow", "datasets": "datasets", "webdataset": "webdataset", "pyarrow": "pyarrow"}


def require(module: str, what: str) -> ModuleType:
    """Import ``module`` or raise an ImportError that names the extra to install.

    >>> require("json", "example").__name__
    'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pip_name = _PIP_NAMES.get(module.split(".")[0], module)
        raise ImportError(
            f"{what} needs the optional package '{pip_name}' ({e}); "
            f"install it with: pip install 'padless[loaders]'"
        ) from e
