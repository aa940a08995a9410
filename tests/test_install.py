"""The wheel a user installs: built from a copy of this checkout, it holds the package, its
``py.typed`` marker, the ``padless`` console command and the extras the README names.

The build runs offline (``--no-build-isolation --no-index``: setuptools from this environment)
in a temporary folder, so the checkout gets no ``build/`` or ``*.egg-info``. About ten seconds.
"""

from __future__ import annotations

import configparser
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    pytest.importorskip("setuptools", reason="building the wheel offline needs setuptools in this environment")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "padless", src / "padless", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(tmp / "out"), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (path,) = (tmp / "out").glob("padless-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def test_the_wheel_holds_the_package_and_its_type_marker(wheel):
    names = set(wheel.namelist())
    assert "padless/py.typed" in names
    for module in ("padless/__init__.py", "padless/__main__.py", "padless/cli/__init__.py", "padless/cli/inspect.py",
                   "padless/loaders/samplers/budget.py", "padless/ops/__main__.py"):
        assert module in names, module
    assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names)


def test_the_wheel_installs_the_padless_command(wheel):
    (ep,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    cfg = configparser.ConfigParser()
    cfg.read_string(wheel.read(ep).decode())
    assert cfg["console_scripts"]["padless"] == "padless.cli:main"


def test_the_wheel_declares_the_extras(wheel):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    text = wheel.read(meta).decode()
    extras = {line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Provides-Extra:")}
    assert {"loaders", "vision", "webdataset", "hf", "plot", "gpu", "dev"} <= extras
    requires = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]
    assert 'pillow; extra == "vision"' in requires and 'matplotlib; extra == "plot"' in requires
    assert 'datasets; extra == "hf"' in requires and 'transformers>=5; extra == "hf"' in requires
    assert any(r.startswith("torch") and "extra" not in r for r in requires)
