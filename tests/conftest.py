import hashlib
import os
import pathlib
import tempfile

# Inductor's caches key a compiled graph on its ops, not on the Python behind padless'
# custom ops (their fake implementations decide output layouts), so a cache written by
# another version of padless can serve a graph whose strides no longer match. The tests
# compile into a cache of their own per padless source, kept across runs of the same source.
# Set before torch is imported: inductor reads the directory once.
_src = hashlib.blake2b(digest_size=8)
for _f in sorted((pathlib.Path(__file__).resolve().parents[1] / "padless").rglob("*.py")):
    _src.update(_f.read_bytes())
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"padless-inductor-{_src.hexdigest()}"))

import pytest  # noqa: E402
import torch  # noqa: E402

import padless  # noqa: E402, F401  (registers handlers)

torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    yield
    if os.environ.get("PADLESS_KEEP_DYNAMO") is None:
        torch._dynamo.reset()


@pytest.fixture
def fresh_dynamo():
    """Compile tests that count graphs: dynamo reset before and after, even with
    ``PADLESS_KEEP_DYNAMO`` set."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def one_thread_module():
    """A module of many tiny cases single-threaded (``pytestmark = pytest.mark.usefixtures(...)``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def one_thread():
    """Run a test single-threaded (same results): tests of many tiny ops would otherwise wait on
    a second OpenMP thread's wake-up on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
