"""How ``torch.compile`` sees padless: its Python code, its tensors and its cache key.

* :func:`_is_traced`: whether a tensor is being traced (Dynamo, fake, functional or meta).
* :func:`mark_dynamic`: batch size, ragged extents and row counts are dynamic sizes from a
  NestedTensor's first compiled call.
* :func:`source_fingerprint`: keys AOTAutograd's cache on padless' own source.
* :func:`install`: the trace rules for padless' directory (below).

None of these needs the NestedTensor class, so :mod:`padless.tensor.core` builds on them.

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

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor as _FunctionalTensor

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

        inline = getattr(trace_rules, "BUILTIN_INLINE_WHEN_CALLED", None)
        if inline is not None:
            inline.add(_DIR)
        else:  # torch < 2.12 has no such table: the same rule, asked first where dynamo checks a file
            _inline_when_called(trace_rules)
        if _DIR not in trace_rules.SKIP_DIRS:
            trace_rules.SKIP_DIRS.append(_DIR)
            trace_rules._recompile_re()
        _done = True
    except (ImportError, AttributeError):  # pragma: no cover - a torch without these tables
        _done = True


def _inline_when_called(trace_rules) -> None:
    """Wrap ``trace_rules.check_file`` (looked up by name when dynamo decides on a file): a file
    of padless is inlined when traced code calls it, and otherwise falls to the skip rules (its
    directory is in ``SKIP_DIRS``), which is what ``BUILTIN_INLINE_WHEN_CALLED`` says from 2.12."""
    base = trace_rules.check_file
    if getattr(base, "_padless", False):
        return

    def check_file(filename, is_inlined_call=False):
        if is_inlined_call and filename is not None and filename.replace(os.sep, "/").startswith(_DIR):
            return trace_rules.SkipResult(False, f"padless, called from traced code ({filename})")
        return base(filename, is_inlined_call)

    check_file._padless = True  # type: ignore[attr-defined]
    trace_rules.check_file = check_file


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


# ---------------------------------------------------------------------------- traced tensors

_TRACED_TYPES = (_FakeTensor, _FunctionalTensor)


def _is_traced(t: Tensor) -> bool:
    """True for fake/functional/meta tensors: we are inside torch.compile or a meta trace."""
    if torch.compiler.is_compiling():  # first: the checks below would break a dynamo graph
        return True
    if isinstance(t, _TRACED_TYPES):
        return True
    return t.is_meta or torch._is_functional_tensor(t)


# ---------------------------------------------------------------------------- dynamic marks


def mark_dynamic(nt):
    """Tell ``torch.compile`` that batch size, ragged extents and row counts vary.

    Called by every user-facing constructor, so a compiled function sees these
    dims as symbolic from its first call: new lengths or a new batch size reuse
    the same graph instead of recompiling. (0 and 1 are still specialised by
    dynamo, as for any tensor.) Returns ``nt`` (a NestedTensor).
    """
    if not torch.compiler.is_compiling():
        _mark(nt)
    return nt


def _mark(nt) -> None:
    """Weak-dynamic marks on NestedTensor ``nt`` and its inner tensors (what
    :func:`mark_dynamic` does).

    ``NestedTensor.__new__`` calls it for every instance, so a batch made by ``detach()``,
    ``to()``, an op run eagerly before a compiled region, or any other path is dynamic
    from its first compiled call. Dims marked this way get their own symbols (no duck
    sizing): a batch size equal to a ragged extent on the first call does not tie the
    two together, so the next batch does not recompile.
    """
    _weak_dynamic(nt, {0, *(r + 1 for r in nt._ragged)})
    for t in (nt._values, nt._offsets, nt._sizes):  # shared by every op output: often marked already
        cur = t.__dict__.get("_dynamo_weak_dynamic_indices")
        if cur is None or 0 not in cur:
            _weak_dynamic(t, {0})


_NEW_MARKS: dict[tuple[int, ...], frozenset] = {}


def _mark_new(nt) -> None:
    """:func:`_mark` for a NestedTensor just made (``NestedTensor.__new__``): it has no marks
    yet, and its inner tensors are usually its source's (marked already)."""
    dims = _NEW_MARKS.get(nt._ragged)
    if dims is None:
        dims = _NEW_MARKS[nt._ragged] = frozenset({0, *(r + 1 for r in nt._ragged)})
    d = nt.__dict__
    d["_dynamo_weak_dynamic_indices"] = set(dims)
    d["_has_dynamo_dim_marking"] = True
    for t in (nt._values, nt._offsets, nt._sizes):  # usually its source's, marked already
        td = t.__dict__
        cur = td.get("_dynamo_weak_dynamic_indices")
        if cur is None:
            td["_dynamo_weak_dynamic_indices"] = {0}
            td["_has_dynamo_dim_marking"] = True
        elif 0 not in cur:
            cur.add(0)
            td["_has_dynamo_dim_marking"] = True


def _weak_dynamic(t: Tensor, dims: set) -> None:
    cur = getattr(t, "_dynamo_weak_dynamic_indices", None)
    if cur is None:
        t._dynamo_weak_dynamic_indices = set(dims)
    else:
        cur.update(dims)
    t._has_dynamo_dim_marking = True


# ---------------------------------------------------------------------------- cache key

_FINGERPRINT: list[str] = []


def source_fingerprint() -> str:
    """blake2b of every padless ``.py`` file (path and content), computed once per process."""
    if not _FINGERPRINT:
        import hashlib
        import pathlib

        root = pathlib.Path(__file__).resolve().parent.parent
        h = hashlib.blake2b(digest_size=12)
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
        _FINGERPRINT.append(h.hexdigest())
    return _FINGERPRINT[0]
