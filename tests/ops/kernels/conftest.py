"""Kernel tests run the Triton kernels against their torch twins.

On CUDA they run in this process. On the CPU they need Triton's interpreter, which
must be switched on (``TRITON_INTERPRET=1``) before ``triton`` is first imported:
``test_interpreter.py`` reruns this folder in a subprocess with that environment,
so the rest of the suite keeps its defaults. Here, without CUDA and without the
interpreter, the kernel tests skip (their subprocess run is the one that counts).
"""

import os

import pytest
import torch

from padless.ops.kernels import dispatch

INTERPRETER_RUN = os.environ.get("TRITON_INTERPRET") == "1"  # read before triton is imported


@pytest.fixture
def kernel_device() -> str:
    """The device kernel tests run on ("cuda", or "cpu" under the interpreter)."""
    missing = dispatch.triton_missing()
    if missing is not None:
        pytest.skip(missing)
    if torch.cuda.is_available() and not INTERPRETER_RUN:
        return "cuda"
    if not INTERPRETER_RUN:
        pytest.skip("CPU kernel tests run under TRITON_INTERPRET=1 in test_interpreter.py's subprocess")
    return "cpu"
