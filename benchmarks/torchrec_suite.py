"""Run TorchRec's own tests for its jagged types against TorchRec and against padless.

    TORCHREC_SRC=/path/to/torchrec-checkout  python benchmarks/torchrec_suite.py [-k EXPR]

Needs an environment with ``torchrec`` (and ``fbgemm-gpu-cpu``), ``pytest`` and
padless installed. The tests are read at run time from ``TORCHREC_SRC``: a TorchRec
source checkout, or a bare git directory (read at ``TORCHREC_REV``, default ``HEAD``);
nothing of TorchRec is copied into this repository. The three suites
(``test_jagged_tensor``, ``test_keyed_jagged_tensor``, ``test_keyed_tensor``) are
written to a temporary folder and run twice with pytest:

* ``torchrec``: unchanged;
* ``padless``: a ``conftest.py`` replaces ``JaggedTensor``, ``KeyedJaggedTensor`` and
  ``KeyedTensor`` in ``torchrec.sparse.jagged_tensor`` by padless' classes before the
  tests import them (TorchRec's helpers such as ``kjt_is_equal`` stay, and run on
  padless objects through their public methods).

Each test is then put in one bucket: passes on both, padless only, TorchRec only, or
neither. A test is counted as depending on TorchRec internals (and left out of the
"comparable" count) when its name or failure mentions FX tracing, TorchScript, fbgemm
ops or private helpers; the printed table gives both counts.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

SUITES = ("test_jagged_tensor", "test_keyed_jagged_tensor", "test_keyed_tensor")
INTERNAL_MARKERS = (
    "jit", "script", "fx", "symbolic_trace", "fbgemm", "torch.ops", "dynamo", "compile", "export",
    "meta_device", "_fields", "dist_", "regroup_kts", "permute_multi_embedding", "KTRegroupAsDict",
)

SHIM = '''
import os
import torchrec.sparse.jagged_tensor as trj
if os.environ.get("PADLESS_SHIM") == "1":
    import padless.jagged as pj
    trj.JaggedTensor = pj.JaggedTensor
    trj.KeyedJaggedTensor = pj.KeyedJaggedTensor
    trj.KeyedTensor = pj.KeyedTensor
'''

REPORT = '''
import json, os
_RESULTS = {}
def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        msg = "" if report.outcome == "passed" else str(report.longrepr)[-600:]
        _RESULTS[report.nodeid] = (report.outcome, msg)
def pytest_sessionfinish(session):
    with open(os.environ["SUITE_OUT"], "w") as f:
        json.dump(_RESULTS, f)
'''


def _read_sources(src: pathlib.Path, rev: str) -> dict[str, str]:
    out = {}
    tests = "torchrec/sparse/tests"
    for name in SUITES + ("utils",):
        work = src / tests / f"{name}.py"
        if work.exists():
            out[name] = work.read_text()
            continue
        res = subprocess.run(
            ["git", f"--git-dir={src}", "show", f"{rev}:{tests}/{name}.py"], capture_output=True, text=True
        )
        if res.returncode:
            raise SystemExit(f"torchrec_suite: cannot read {tests}/{name}.py from {src} at {rev}: {res.stderr}")
        out[name] = res.stdout
    return out


def _run(folder: pathlib.Path, shim: bool, extra: list[str]) -> dict[str, tuple[str, str]]:
    out = folder / ("padless.json" if shim else "torchrec.json")
    env = dict(os.environ, PADLESS_SHIM="1" if shim else "0", SUITE_OUT=str(out))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder), *extra]
    subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=1800)
    return json.loads(out.read_text()) if out.exists() else {}


def _internal(nodeid: str, msg: str) -> bool:
    text = (nodeid + " " + msg).lower()
    return any(m.lower() in text for m in INTERNAL_MARKERS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=os.environ.get("TORCHREC_SRC"))
    ap.add_argument("--rev", default=os.environ.get("TORCHREC_REV", "HEAD"))
    ap.add_argument("--show", action="store_true", help="list each test padless fails and why")
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    try:
        import torchrec  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"torchrec_suite: needs torchrec in this environment ({e})")
    if not args.src:
        raise SystemExit("torchrec_suite: set TORCHREC_SRC (or --src) to a TorchRec checkout or git directory")
    sources = _read_sources(pathlib.Path(args.src), args.rev)
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        for name, text in sources.items():
            if name == "utils":
                continue
            (folder / f"{name}.py").write_text(text.replace("torchrec.sparse.tests.utils", "suite_utils"))
        (folder / "suite_utils.py").write_text(sources["utils"])
        (folder / "conftest.py").write_text(SHIM + REPORT)
        ref = _run(folder, False, args.pytest_args)
        ours = _run(folder, True, args.pytest_args)
    ids = sorted(set(ref) | set(ours))
    skipped = [i for i in ids if ref.get(i, ("",))[0] == "skipped" and ours.get(i, ("",))[0] == "skipped"]
    ids = [i for i in ids if i not in skipped]
    buckets: dict[str, list[str]] = {"both": [], "padless only": [], "torchrec only": [], "neither": []}
    internal = []
    for i in ids:
        r, o = ref.get(i, ("missing", ""))[0] == "passed", ours.get(i, ("missing", ""))[0] == "passed"
        buckets["both" if r and o else "padless only" if o else "torchrec only" if r else "neither"].append(i)
        if not o and _internal(i, ours.get(i, ("", ""))[1]):
            internal.append(i)
    comparable = [i for i in ids if i not in internal]
    p_ok = sum(1 for i in ids if ours.get(i, ("",))[0] == "passed")
    t_ok = sum(1 for i in ids if ref.get(i, ("",))[0] == "passed")
    t_cmp = sum(1 for i in comparable if ref.get(i, ("",))[0] == "passed")
    print(f"TorchRec tests from {args.src} @ {args.rev}: {len(ids)} run ({len(skipped)} skipped here: CUDA)")
    print(f"  torchrec passes {t_ok}/{len(ids)}; padless passes {p_ok}/{len(ids)}")
    print(f"  padless failures that touch TorchRec internals (fx/jit/fbgemm/private): {len(internal)}")
    print(f"  of the {len(comparable)} other tests: padless passes {p_ok}, torchrec {t_cmp}")
    for k, v in buckets.items():
        print(f"  {k:14s} {len(v)}")
    if args.show:
        for name, res in (("padless", ours), ("torchrec", ref)):
            for i in ids:
                o = res.get(i, ("missing", ""))
                if o[0] != "passed":
                    tag = "internal" if i in internal else "GAP"
                    last = o[1].strip().splitlines()[-1] if o[1].strip() else o[0]
                    print(f"[{name} {tag}] {i}: {last[:200]}")


if __name__ == "__main__":
    main()
