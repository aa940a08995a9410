"""Run PyTorch's own jagged-layout (NJT) tests against torch.nested and against padless.nested.

    NJT_TESTS=/path/to/test_nestedtensor.py  python benchmarks/njt_suite.py [--show] [-- PYTEST_ARGS]

``NJT_TESTS`` (or ``--src``) is PyTorch's ``test/test_nestedtensor.py`` for the installed
torch: a file, a PyTorch checkout (``test/test_nestedtensor.py`` inside it) or a bare git
directory (read at ``NJT_REV``, default ``HEAD``). Nothing of PyTorch is copied into this
repository; the file is written to a temporary folder at run time. What the tests import from
``torch.testing._internal`` ships in the torch wheel (``expecttest`` must be installed).

Two test classes run, on the CPU (``-k`` filters):

* ``TestNestedTensorSubclass``: the jagged-layout subclass tests;
* ``TestNestedTensorOpInfo`` ``test_forward`` / ``test_backward``: every NJT OpInfo sample,
  compared with the per-sample reference (``--no-opinfo`` leaves them out).

Each runs twice with pytest:

* ``njt``: unchanged, with NJT's own sample xfail/skip rules (the suite as PyTorch runs it);
* ``padless``: a ``conftest.py`` redirects the six public constructors
  (``nested_tensor``, ``as_nested_tensor``, ``nested_tensor_from_jagged``, ``narrow``,
  ``to_padded_tensor``, ``masked_select``) to ``padless.nested``, gives padless tensors NJT's
  private attribute names (``_ragged_idx``, ``_lengths``, ``_metadata_cache``,
  ``_max_seqlen``/``_min_seqlen``, ``_max/_min_seqlen_tensor`` (None: no cached tensors),
  ``_get_max_seqlen()``/``_get_min_seqlen()``), lets
  ``assertEqualIgnoringNestedInts`` compare padless tensors sample by sample, and drops NJT's
  sample xfail rules (they describe NJT's own bugs: a padless OpInfo test passes only when
  every sample passes). ``--strict`` drops the rules for the NJT run too.

The OpInfo references and sample generators ask ``x.is_nested``, ``is_nested_int(x.size(d))``,
``x.is_contiguous()`` and ``x.values()`` the NJT way; while a reference or a generator runs
(and only then) padless tensors answer as NJT would (nested, nested-int ragged sizes, NJT's
contiguity and values dim order), so both sides get the same samples and the references
can slice padless inputs. Each OpInfo sample is a unittest subTest: a test fails when any
of its samples fails, samples are counted one by one, and the samples NJT's own rules
expect to fail are marked (they run inside ``assertRaises``). With both sides the script
lists the samples NJT passes and padless fails (``--show``).

Every test is put in one bucket (both, padless only, NJT only, neither), and each padless
failure in a failure category read from its message (private internals, nested ints, error
type/message, layout/is_nested, compile, missing op, wrong result, ...). Runs made
separately (``--only``, ``-k`` parts, ``--json``) are summarised together with
``--merge a.json b.json ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

TEST_PATH = "test/test_nestedtensor.py"
DEFAULT_K = "TestNestedTensorSubclass or (TestNestedTensorOpInfo and (test_forward or test_backward))"

SHIM = r'''
import os
import torch

if os.environ.get("PADLESS_SHIM") == "1" or os.environ.get("NJT_STRICT") == "1":
    # Drop NJT's per-sample xfail / skip rules before the test module builds its tests.
    from torch.testing._internal.opinfo import core as _core

    def _no_rules(self, rules):
        self.rules = []

    _core.sample_skips_and_xfails.__init__ = _no_rules

if os.environ.get("PADLESS_SHIM") == "1":
    import padless.nested as _pn
    from padless.tensor.core import NestedTensor as _PNT
    from torch.testing._internal import common_utils as _cu
    from torch.utils import _pytree as _pytree

    for _name in ("nested_tensor", "as_nested_tensor", "nested_tensor_from_jagged", "narrow",
                  "to_padded_tensor", "masked_select"):
        setattr(torch.nested, _name, getattr(_pn, _name))

    # NJT's private attribute names, read the padless way (harness-only adapter).
    def _ragged_idx(self):
        return 1 + self.storage_order[0] if len(self._ragged) == 1 else None

    def _seqlens(self):
        if len(self._ragged) != 1:
            return None
        return self.host_sizes()[:, self._ragged[0]]

    def _max(self):
        s = _seqlens(self)
        return None if s is None or s.numel() == 0 else int(s.max())

    def _min(self):
        s = _seqlens(self)
        return None if s is None or s.numel() == 0 else int(s.min())

    def _cache(self):
        return {k: v for k, v in (("max_seqlen", _max(self)), ("min_seqlen", _min(self))) if v is not None}

    for _attr, _fn in (("_ragged_idx", _ragged_idx), ("_max_seqlen", _max), ("_min_seqlen", _min),
                       ("_metadata_cache", _cache), ("_lengths", lambda self: None),
                       ("_max_seqlen_tensor", lambda self: None), ("_min_seqlen_tensor", lambda self: None)):
        if not hasattr(_PNT, _attr):
            setattr(_PNT, _attr, property(_fn))
    if not hasattr(_PNT, "_get_max_seqlen"):
        _PNT._get_max_seqlen = _max
        _PNT._get_min_seqlen = _min

    def _unbind_padless(x):
        return list(x.unbind()) if isinstance(x, _PNT) else x

    _orig_eq = _cu.NestedTensorTestCase.assertEqualIgnoringNestedInts
    _orig_nc = _cu.NestedTensorTestCase.assertEqualNoncontigAware

    def _eq(self, a, b):
        _orig_eq(self, _pytree.tree_map(_unbind_padless, a), _pytree.tree_map(_unbind_padless, b))

    def _nc(self, a, b):
        _orig_nc(self, _pytree.tree_map(_unbind_padless, a), _pytree.tree_map(_unbind_padless, b))

    _cu.NestedTensorTestCase.assertEqualIgnoringNestedInts = _eq
    _cu.NestedTensorTestCase.assertEqualNoncontigAware = _nc

    # The OpInfo references and sample generators ask padless tensors NJT's questions. While
    # a reference or a generator runs, and only then, padless answers as NJT would: the
    # answers are installed on the class on entry and removed on exit, so the ops under test
    # (and Dynamo, in the compile tests) never see them.
    from torch.testing._internal.opinfo.definitions import nested as _ndefs

    _missing = object()

    class _RaggedSize(int):
        """A ragged size, read by the patched ``is_nested_int`` as a nested int."""

    def _njt_values(self):
        # A transposed NJT's values() is a transposed view of its buffer; padless stores such
        # a tensor ragged dim first. The reduction references map dims onto NJT's order.
        v, order = _plain_values(self), self.storage_order
        if len(self._ragged) == 1 and tuple(order) != tuple(range(len(order))):
            return v.permute([order.index(d) for d in range(len(order))])
        return v

    def _njt_size(self, *args, **kwargs):
        # The generators skip inputs NJT cannot take with ``is_nested_int(x.size(d))``.
        out = _plain_size(self, *args, **kwargs)
        dim = args[0] if args else kwargs.get("dim")
        if isinstance(dim, int) and isinstance(out, int) and dim % self.dim() == self._ragged_idx:
            return _RaggedSize(out)
        return out

    def _njt_is_contiguous(self, *args, **kwargs):
        # NJT's transposed tensors are strided views; padless stores them packed.
        order = self.storage_order
        if tuple(order) != tuple(range(len(order))):
            return False
        return _plain_is_contiguous(self, *args, **kwargs)

    _plain_values, _plain_size, _plain_is_contiguous = _PNT.values, _PNT.size, _PNT.is_contiguous
    # references find nested inputs with ``x.is_nested`` and slice ``x.values()``
    _REF_ANSWERS = {"is_nested": property(lambda self: True), "values": _njt_values}
    # generators ask ``is_nested_int(x.size(d))`` and ``x.is_contiguous()``
    _GEN_ANSWERS = {"size": _njt_size, "is_contiguous": _njt_is_contiguous}
    _depth = {}

    def _enter(answers):
        key = id(answers)
        _depth[key] = _depth.get(key, 0) + 1
        if _depth[key] == 1:
            answers["__saved__"] = {n: _PNT.__dict__.get(n, _missing) for n in answers if n != "__saved__"}
            for n, fn in answers.items():
                if n != "__saved__":
                    setattr(_PNT, n, fn)

    def _exit(answers):
        key = id(answers)
        _depth[key] -= 1
        if _depth[key] == 0:
            for n, orig in answers.pop("__saved__").items():
                if orig is _missing:
                    delattr(_PNT, n)
                else:
                    setattr(_PNT, n, orig)

    _plain_is_nested_int = _ndefs.is_nested_int
    _ndefs.is_nested_int = lambda x: isinstance(x, _RaggedSize) or _plain_is_nested_int(x)

    def _wrap_ref(ref):
        def reference(*a, **kw):
            _enter(_REF_ANSWERS)
            try:
                return ref(*a, **kw)
            finally:
                _exit(_REF_ANSWERS)
        return reference

    def _wrap_gen(func):
        def samples(*a, **kw):
            it = iter(func(*a, **kw))
            while True:
                _enter(_GEN_ANSWERS)
                try:
                    item = next(it)
                except StopIteration:
                    return
                finally:
                    _exit(_GEN_ANSWERS)
                yield item
        return samples

    for _op in _ndefs.njt_op_db:
        if getattr(_op, "ref", None) is not None:
            _op.ref = _wrap_ref(_op.ref)
        _op.sample_inputs_func = _wrap_gen(_op.sample_inputs_func)
'''

REPORT = r'''
import json, os
from torch.testing._internal.opinfo import core as _opcore

# A sample NJT's rules expect to fail runs inside assertRaises and so "passes": mark it.
_xfail_hit = [False]
_orig_xfail_ctx = _opcore.XFailRule.get_context


def _xfail_ctx(self, test_case):
    _xfail_hit[0] = True
    return _orig_xfail_ctx(self, test_case)


_opcore.XFailRule.get_context = _xfail_ctx


def pytest_runtest_logreport(report):
    # One JSON line per test, written as it finishes: a run cut by the timeout keeps its results.
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        # The OpInfo tests run each sample as a unittest subTest: pytest reports every sample
        # under the test's id, then the test itself, which passes even when samples failed.
        msg = "" if report.outcome == "passed" else str(report.longrepr)[-1500:]
        ctx = getattr(report, "context", None)
        kind = "sample" if ctx is not None else "test"
        idx = str(ctx.kwargs.get("idx", "")) if ctx is not None else ""
        outcome = report.outcome
        if ctx is not None:
            if _xfail_hit[0] and outcome == "passed":
                outcome = "xfailed"
            _xfail_hit[0] = False
        with open(os.environ["SUITE_OUT"], "a") as f:
            f.write(json.dumps([report.nodeid, outcome, msg, kind, idx]) + "\n")
'''

# (category, pattern on the test id + failure message), first match wins. The first group
# are torch internals padless does not aim at (nested ints as SymInts, fx, profiler, NJT's
# private classes and caches); the rest are behaviour.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("internals: nested int / SymInt shapes", r"SymInt|nested_int|NestedIntNode|get_tensor_symint|is_nested_int"),
    ("internals: NJT private API", r"_metadata_cache|_base is|_is_view|_view_func|ViewNestedFromBuffer|jagged_from_list"
     r"|nested_view_from_values_offsets|nested_from_padded|_nested_tensor_from|torch\.nested\._internal|_size\b|_strides"
     r"|buffer_from_jagged|_rebuild_njt|safe_globals|aten\.size|sym_size|sym_numel|sym_stride|test_tensor_attributes"),
    ("internals: fx / profiler / dispatch modes", r"symbolic_trace|profiler|prof\.events|TorchDispatchMode|logging_tensor|explain"),
    ("layout / is_nested", r"is_nested|layout|torch\.jagged|torch\.strided"),
    ("compile", r"torch\._dynamo|Dynamo|compile|Unsupported:|InternalTorchDynamoError|BackendCompilerFailed|inductor"),
    ("error type or message differs", r"does not match|AssertionError: \w+Error not raised|not raised|Regex didn't match"),
    ("op or argument not supported by padless", r"NotImplementedError|no handler|not supported|unsupported|refuses"),
    ("wrong values or shapes", r"AssertionError|Mismatch|not equal|not close"),
)


def read_source(src: pathlib.Path, rev: str) -> str:
    """The text of ``test_nestedtensor.py`` from a file, a checkout or a bare git directory."""
    if src.is_file():
        return src.read_text()
    if (src / TEST_PATH).exists():
        return (src / TEST_PATH).read_text()
    res = subprocess.run(["git", f"--git-dir={src}", "show", f"{rev}:{TEST_PATH}"], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"njt_suite: cannot read {TEST_PATH} from {src} at {rev}: {res.stderr.strip()}")
    return res.stdout


def run(folder: pathlib.Path, mode: str, strict: bool, extra: list[str], timeout: int) -> tuple[dict, float]:
    """Run the suite once (``mode`` is ``njt`` or ``padless``); {nodeid: (outcome, message)}, seconds."""
    out = folder / f"{mode}.json"
    env = dict(os.environ, PADLESS_SHIM="1" if mode == "padless" else "0", NJT_STRICT="1" if strict else "0",
               SUITE_OUT=str(out), PYTORCH_TEST_WITH_SLOW="0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_nestedtensor.py", *extra]
    t0 = time.perf_counter()
    try:
        subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"njt_suite: the {mode} run hit the {timeout} s timeout; counting what finished")
    samples: dict = {}
    res = read_results(out, samples)
    SAMPLES[mode] = {f"{n}|{i}": o for (n, i), o in samples.items()}
    return res, time.perf_counter() - t0


SAMPLES: dict[str, dict[str, str]] = {}


def read_results(out: pathlib.Path, samples: dict | None = None) -> dict:
    """{nodeid: (outcome, message, samples passed, samples failed)} from a run's report lines.

    A test fails when it or any of its samples (subtests) failed; its message is the first
    failure's. A test without subtests counts as one sample. ``samples``, when given, is
    filled with {(nodeid, sample index): outcome}."""
    res: dict[str, tuple[str, str, int, int]] = {}
    if not out.exists():
        return res
    for line in out.read_text().splitlines():
        nodeid, outcome, msg, *rest = json.loads(line)
        kind = rest[0] if rest else "test"
        if kind == "sample" and samples is not None:
            samples[(nodeid, rest[1])] = outcome
        prev_outcome, prev_msg, ok, bad = res.get(nodeid, ("", "", 0, 0))
        if kind == "sample":
            ok, bad = ok + (outcome == "passed"), bad + (outcome == "failed")
        elif ok + bad == 0:
            ok, bad = int(outcome == "passed"), int(outcome == "failed")
        if prev_outcome == "failed":
            outcome, msg = prev_outcome, prev_msg
        res[nodeid] = (outcome, msg, ok, bad)
    return res


def category(nodeid: str, msg: str) -> str:
    """The failure category of one failed test (see ``CATEGORIES``)."""
    # An OpInfo failure message prints the sample (its repr mentions layouts and jagged
    # dims), so only its error line is read.
    text = nodeid + "\n" + (last_line(msg) if "OpInfo" in nodeid else msg)
    for name, pattern in CATEGORIES:
        if re.search(pattern, text):
            return name
    return "other error"


def last_line(msg: str) -> str:
    lines = [ln for ln in msg.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.match(r"^E\s+\w*(Error|Exception)", ln)]
    return (errs[-1] if errs else lines[-1] if lines else "").strip()[:220]


def group(nodeid: str) -> str:
    if "OpInfo" in nodeid:
        return "opinfo backward" if "test_backward" in nodeid else "opinfo forward" if "test_forward" in nodeid else "opinfo other"
    return "subclass"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=os.environ.get("NJT_TESTS"), help="test_nestedtensor.py, a checkout or a git dir")
    ap.add_argument("--rev", default=os.environ.get("NJT_REV", "HEAD"))
    ap.add_argument("-k", default=DEFAULT_K, help="pytest -k filter (default: subclass + OpInfo forward/backward)")
    ap.add_argument("--no-opinfo", action="store_true", help="only the subclass tests")
    ap.add_argument("--only", choices=("njt", "padless"), help="run one side only")
    ap.add_argument("--strict", action="store_true", help="drop NJT's sample xfail rules in the NJT run too")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per pytest run")
    ap.add_argument("--show", action="store_true", help="list every failing test with its last error line")
    ap.add_argument("--json", help="write the per-test outcomes of both runs here")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="summarise --json files of earlier runs instead of running")
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    k = "TestNestedTensorSubclass" if args.no_opinfo else args.k
    results: dict[str, dict] = {}
    seconds: dict[str, float] = {}
    if args.merge:
        # Summarise runs made separately (e.g. --only njt, then --only padless in parts).
        k = "merged: " + ", ".join(args.merge)
        for path in args.merge:
            saved = json.loads(pathlib.Path(path).read_text())
            for mode, res in saved["tests"].items():
                results.setdefault(mode, {}).update({i: tuple(v) for i, v in res.items()})
            for mode, smp in saved["samples"].items():
                SAMPLES.setdefault(mode, {}).update(smp)
    elif not args.src:
        raise SystemExit("njt_suite: set NJT_TESTS (or --src) to PyTorch's test/test_nestedtensor.py for this torch")
    with tempfile.TemporaryDirectory() as tmp:
        if args.merge:
            pass
        else:
            text = read_source(pathlib.Path(args.src), args.rev)
            extra = ["-k", k, *args.pytest_args]
            folder = pathlib.Path(tmp)
            (folder / "test_nestedtensor.py").write_text(text)
            (folder / "conftest.py").write_text(SHIM + REPORT)
            for mode in ("njt", "padless"):
                if args.only in (None, mode):
                    results[mode], seconds[mode] = run(folder, mode, args.strict, extra, args.timeout)
    ids = sorted(set().union(*[set(r) for r in results.values()]))
    outcome = {m: {i: r.get(i, ("missing", ""))[0] for i in ids} for m, r in results.items()}
    ran = [i for i in ids if any(outcome[m][i] != "skipped" for m in results)]
    import torch

    source = f"{args.src} @ {args.rev}" if args.src else "saved runs"
    print(f"NJT's own tests ({source}), torch {torch.__version__}, -k {k!r}")
    print(f"  {len(ran)} tests ran on the CPU ({len(ids) - len(ran)} skipped: CUDA-only or skipped by the suite)")
    for grp in ("subclass", "opinfo forward", "opinfo backward", "opinfo other"):
        g = [i for i in ran if group(i) == grp]
        if g:
            cells = ", ".join(f"{m} {sum(outcome[m][i] == 'passed' for i in g)}/{len(g)}" for m in results)
            print(f"  {grp:16s} {cells}")
            if grp.startswith("opinfo"):
                cells = ", ".join(
                    f"{m} {sum(r.get(i, ('', '', 0, 0))[2] for i in g)}/"
                    f"{sum(sum(r.get(i, ('', '', 0, 0))[2:]) for i in g)}" for m, r in results.items())
                print(f"  {'  samples':16s} {cells}")
                if "njt" in SAMPLES:
                    rules = [o for key, o in SAMPLES["njt"].items() if group(key.split("|")[0]) == grp]
                    print(f"  {'':16s} NJT's rules: {rules.count('xfailed')} samples expected to fail, "
                          f"{rules.count('skipped')} skipped (not counted above)")
    for m, s in seconds.items():
        print(f"  {m} run: {s:.0f} s")
    if len(results) == 2:
        both = {"both": 0, "padless only": 0, "njt only": 0, "neither": 0}
        for i in ran:
            n, p = outcome["njt"][i] == "passed", outcome["padless"][i] == "passed"
            both["both" if n and p else "padless only" if p else "njt only" if n else "neither"] += 1
        print("  " + ", ".join(f"{k}: {v}" for k, v in both.items()))
    if len(SAMPLES) == 2:
        njt_ok = {k for k, o in SAMPLES["njt"].items() if o == "passed"}
        gaps = sorted(k for k in njt_ok if SAMPLES["padless"].get(k) == "failed")
        both_bad = sum(o == "failed" and SAMPLES["njt"].get(k) == "failed" for k, o in SAMPLES["padless"].items())
        xf = sum(o == "xfailed" for o in SAMPLES["njt"].values())
        print(f"  samples NJT passes and padless fails: {len(gaps)}; samples both fail: {both_bad}; "
              f"samples NJT's rules expect to fail: {xf}")
        if args.show:
            for k in gaps:
                nodeid, idx = k.split("|")
                print(f"    [gap] {nodeid.split('::')[-1]} sample {idx}")
    for m, res in results.items():
        fails = [i for i in ran if outcome[m][i] not in ("passed", "skipped")]
        cats: dict[str, list[str]] = {}
        for i in fails:
            cats.setdefault(category(i, res.get(i, ("", ""))[1]), []).append(i)
        print(f"  {m} failures by category ({len(fails)}):")
        for name, members in sorted(cats.items(), key=lambda kv: -len(kv[1])):
            by_grp = {}
            for i in members:
                by_grp[group(i)] = by_grp.get(group(i), 0) + 1
            print(f"    {len(members):4d}  {name}  ({', '.join(f'{g} {c}' for g, c in by_grp.items())})")
        if args.show:
            for i in fails:
                print(f"    [{m}] {i.split('::')[-1]}: {last_line(res.get(i, ('', ''))[1])}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"tests": results, "samples": SAMPLES}))


if __name__ == "__main__":
    main()
