# `make demo` and `make test` work on a fresh machine that has only Python: they create .venv and
# install through constraints.txt (torch pinned, so pip never fetches a CUDA build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean gpu-check-folders

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m partitioner.cli.demo

test: $(STAMP)
	$(PY) -m pytest -x --durations=10

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# The one-GPU check's program folders, compiled here (OR-Tools) on the meta device: carry
# gpu_check_folders to the GPU machine (docs/gpu.md, "On one GPU: the readiness check").
gpu-check-folders: $(STAMP)
	$(PY) benchmarks/gpu_check.py prepare --out gpu_check_folders

clean:
	rm -rf $(VENV) build *.egg-info
