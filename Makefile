# Two set-up-free commands: `make serve` and `make test`. Both bootstrap .venv idempotently,
# installing the pinned CPU torch first so pip never pulls a CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tokenmill-bootstrap
TORCH_PIN := torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: bootstrap test serve lint clean

bootstrap: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIN)
	echo "$(TORCH_PIN)" > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e '.[dev]'
	$(BIN)/python -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') else 'unexpected torch ' + v)"
	# build the C++ CPU kernels now (cached by torch), not in the first `tokenmill serve` (a warning if no compiler)
	$(BIN)/python -c "from tokenmill.kernels import load_cpu_kernels; load_cpu_kernels()"
	touch $(STAMP)

test: bootstrap
	$(BIN)/python -m pytest -q tests

serve: bootstrap
	$(BIN)/tokenmill serve models/tokenmill-demo --host $(HOST) --port $(PORT)

lint: bootstrap
	$(BIN)/ruff check src tests tools
	$(BIN)/mypy

clean:
	rm -rf $(VENV)
