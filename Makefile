# Each target sets itself up on a fresh machine: a virtual environment in .venv,
# torch (TORCH_SPEC; the CPU wheel by default) and padless with its [dev] extra.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.padless-installed

.PHONY: setup demo test bench docs clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py
	$(PY) examples/swap_collate.py
	$(PY) examples/image_stream.py
	$(PY) examples/native_cnn.py

test: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

docs: $(STAMP)
	mkdir -p build
	$(PY) -m padless.ops --markdown > build/ops.md && mv build/ops.md docs/ops.md
	$(PY) -m mkdocs build --strict --site-dir build/site

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# The model zoo: its own environment (zoo/.venv, never .venv) with real model packages; see docs/zoo.md.
# torch is the registry's CUDA build of 2.13.0 (torch===2.13.0; the local CPU wheel is 2.13.0+cpu),
# because the registry's torchvision is a CUDA build that does not import next to the CPU torch.
ZOO_VENV ?= zoo/.venv
ZOO_PY := $(ZOO_VENV)/bin/python
ZOO_STAMP := $(ZOO_VENV)/.zoo-installed
ZOO_NO_DEPS := torchvision==0.28.0 boltz==2.2.1 torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0

.PHONY: zoo

$(ZOO_STAMP): zoo/requirements.txt zoo/constraints.txt
	test -x $(ZOO_PY) || $(PYTHON) -m venv $(ZOO_VENV)
	$(ZOO_PY) -m pip install --quiet "torch===2.13.0"
	$(ZOO_PY) -m pip install --quiet --no-deps -c zoo/constraints.txt $(ZOO_NO_DEPS)
	$(ZOO_PY) -m pip install --quiet -c zoo/constraints.txt -r zoo/requirements.txt
	$(ZOO_PY) -m pip install --quiet --no-deps -e .
	touch $(ZOO_STAMP)

zoo: $(ZOO_STAMP)
	$(ZOO_PY) benchmarks/zoo.py
