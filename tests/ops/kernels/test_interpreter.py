"""Run this folder's kernel tests on the CPU, in Triton's interpreter (a subprocess).

``TRITON_INTERPRET=1`` only takes effect when set before ``triton`` is imported, so
the kernel tests run in a fresh interpreter with it set; everything else in the
suite keeps the default environment.
"""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from padless.ops.kernels import dispatch

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already inside the interpreter run")
def test_kernels_under_the_interpreter():
    missing = dispatch.triton_missing()
    if missing is not None:
        pytest.skip(missing)
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the kernel tests run compiled in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PADLESS_KERNELS", None)
    # the interpreter evaluates masked-out lanes too (log(0), 0/0 there are discarded)
    quiet = ["-W", "ignore::RuntimeWarning"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *quiet, str(HERE)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"kernel tests failed under TRITON_INTERPRET=1:\n{tail}"
