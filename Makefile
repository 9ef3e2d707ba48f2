# cdc-relay: `make demo` shows the relay at work, `make test` runs every check.
# Both set up what is missing first (PostgreSQL 15 + wal2json from Debian, the Python
# packages in .venv, the Kafka jars from Maven Central, cached under ~/.cache).

VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: install test check lint typecheck unit integration demo clean

# Idempotent, and quick once everything is there.
install:
	bash .ci/install

check: lint typecheck

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

unit: install
	$(PY) -m pytest tests/unit

integration: install
	$(PY) -m pytest tests/integration

test: check
	$(PY) -m pytest tests

demo: install
	$(PY) demo/run.py

clean:
	rm -rf .demo .pytest_cache .mypy_cache .ruff_cache
