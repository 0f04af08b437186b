# Two entry points for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test test-openai2 lint typecheck clean

$(BIN)/kvlease: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,router,connector,stack,langchain,analyze,frameworks]'
	touch $@

install: $(BIN)/kvlease

demo: install
	$(BIN)/kvlease demo

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy sdk/kvlease

clean:
	rm -rf $(VENV) build *.egg-info

# The SDK on openai 2.x (httpx) as well as on openai 3.x (httpx2, the default above).
$(VENV)-openai2/bin/kvlease: pyproject.toml
	$(PY) -m venv $(VENV)-openai2
	$(VENV)-openai2/bin/pip install -q --upgrade pip
	$(VENV)-openai2/bin/pip install -q -e . 'openai==2.54.0' 'httpx==0.28.1' 'pytest==9.0.3' 'pytest-asyncio==1.5.0' 'pytest-timeout==2.4.0' 'hypothesis==6.155.2'
	touch $@

test-openai2: $(VENV)-openai2/bin/kvlease
	$(VENV)-openai2/bin/python -m pytest tests/sdk --ignore=tests/sdk/analyze -p no:cacheprovider
