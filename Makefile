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
