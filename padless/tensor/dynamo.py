"""How ``torch.compile`` treats padless' own Python code.

Dynamo traces (inlines) padless functions when a compiled function calls them, which is
what makes ``fullgraph=True`` work on NestedTensors. But when Dynamo gives up on a frame
(an op that needs host metadata, like building pair maps) it runs that frame eagerly and
would then try to compile every padless frame it enters as a graph of its own, including
``NestedTensor.__new__`` halfway through constructing an object. padless therefore
registers its directory the way torch registers its own helpers: inlined when called from
traced code, never compiled as a frame of its own. Those eager fallbacks then simply run
eagerly.

The registration needs Dynamo's trace rules. So that ``import padless`` does not import
Dynamo (about a second), it happens when Dynamo itself is imported (or at once if it
already was). These are private Dynamo tables; if they change, padless still works
eagerly and under ``fullgraph=True``, and only the eager-fallback case loses this
protection.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace(os.sep, "/") + "/"
_TARGET = "torch._dynamo.trace_rules"
_done = False


def register() -> None:
    """Make Dynamo inline padless code when called from traced code, and skip it as a frame."""
    global _done
    if _done:
        return
    try:
        from torch._dynamo import trace_rules

        trace_rules.BUILTIN_INLINE_WHEN_CALLED.add(_DIR)
        if _DIR not in trace_rules.SKIP_DIRS:
            trace_rules.SKIP_DIRS.append(_DIR)
            trace_rules._recompile_re()
        _done = True
    except (ImportError, AttributeError):  # pragma: no cover - a torch without these tables
        _done = True


class _AfterDynamoLoads(importlib.abc.MetaPathFinder):
    """Runs :func:`register` right after ``torch._dynamo.trace_rules`` is imported."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[override]
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            sys.modules[fullname] = module
            register()

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def install() -> None:
    if _TARGET in sys.modules:
        register()
    elif not any(isinstance(f, _AfterDynamoLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamoLoads())
