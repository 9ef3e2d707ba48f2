# cdc-relay: `make demo` shows the relay at work, `make test` runs every check.
# Both set up what is missing first (PostgreSQL 15 + wal2json from Debian, the Python
# packages in .venv, the Kafka jars from Maven Central, cached under ~/.cache).

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test check lint typecheck unit integration demo clean

install: $(STAMP)

$(STAMP): pyproject.toml .ci/install
	bash .ci/install
	touch $@

check: lint typecheck

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest tests/unit

integration: $(STAMP)
	$(PY) -m pytest tests/integration

test: check
	$(PY) -m pytest tests

demo: $(STAMP)
	$(PY) demo/run.py

clean:
	rm -rf .demo .pytest_cache .mypy_cache .ruff_cache
