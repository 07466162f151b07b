# dpserve — the two commands a new machine needs are `make demo` and `make test`;
# both install on first use.
VENV        ?= .venv
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.dpserve-installed
MODEL_DIR   ?= build/tiny-llama
PYTEST_ARGS ?=

.PHONY: install model demo test test-unit lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh scripts/pip_settings.py
	bash scripts/install.sh
	touch $@

model: install
	$(BIN)/dpserve build-tiny-model --output $(MODEL_DIR)

demo: model
	$(BIN)/dpserve demo --model $(MODEL_DIR)

test: model
	DPSERVE_TEST_MODEL=$(abspath $(MODEL_DIR)) bash scripts/test.sh $(BIN) $(PYTEST_ARGS)

test-unit: model
	DPSERVE_TEST_MODEL=$(abspath $(MODEL_DIR)) $(BIN)/pytest --ignore=tests/integration $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: install
	$(BIN)/python -m benchmarks.router.overhead

clean:
	rm -rf build runs
