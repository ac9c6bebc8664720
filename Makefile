# Everything runs in .venv/ inside the repository.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.installed-serve
DEMO    := data/demo
INDEXES ?= indexes
# make serve PORT=8201, or DUET_PORT=8201 make serve: either works (the variable wins)
HOST    ?= $(or $(DUET_HOST),127.0.0.1)
PORT    ?= $(or $(DUET_PORT),8000)

.PHONY: install serve test test-fast lint demo-index clean

# what `make serve` needs (the service, the builder, the shipped model): no dev tools
$(SERVE_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: a CPU build here; GPU images install their own build
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $(SERVE_STAMP)

# tests, lint, benchmarks, Hugging Face and Ray extras on top
$(STAMP): $(SERVE_STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo-index: $(SERVE_STAMP)
	$(BIN)/duet demo-index --out $(INDEXES) --corpus-out $(DEMO) --images 2000 --seed 7

serve: demo-index
	@echo ""
	@echo "duet on http://$(HOST):$(PORT) -- try:"
	@echo "  curl -s -X POST http://$(HOST):$(PORT)/search/text -H 'content-type: application/json' -d '{\"query\": \"a small red diamond left of a small yellow triangle\", \"top_k\": 5}'"
	@echo "  curl -s -X POST http://$(HOST):$(PORT)/search/image -F image=@$(DEMO)/images/0007.png -F top_k=5"
	@echo ""
	DUET_INDEX_DIR=$(INDEXES) DUET_IMAGES_DIR=$(DEMO) DUET_HOST=$(HOST) DUET_PORT=$(PORT) $(BIN)/duet serve

# installs the system tools pip cannot (apt-get, where it may), or says what will be skipped
test: $(STAMP)
	@bash tests/system-tools.sh
	$(BIN)/python -m pytest -q --durations=25

# the inner loop: everything that needs no real service, index build or training
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy --explicit-package-bases benchmarks/*.py  # scripts, not a package

clean:
	rm -rf $(VENV) $(INDEXES) $(DEMO) .pytest_cache .mypy_cache .ruff_cache
