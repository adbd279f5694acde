# Everything runs from a local virtualenv made on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PG_VERSION := $(shell ls /etc/postgresql 2>/dev/null | head -n1)

.PHONY: demo test test-fast test-clients lock-clients test-faults test-pgbouncer fuzz lint bench postgres chromium prometheus kubectl java faketime pgbouncer lock reference docs docs-build

# Installed from the lock by uv (at the version pinned below; a quarter of pip's time), every
# version exact and every file checked against its hash; then the package alone, built by the
# locked setuptools (nothing resolved, nothing fetched).
UV_VERSION := 0.13.9
UV = $(BIN)/uv pip install -q --python $(BIN)/python
$(BIN)/metering: pyproject.toml requirements-test.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv==$(UV_VERSION)
	$(UV) --require-hashes -r requirements-test.lock
	$(UV) --no-deps --no-build-isolation -e .
	touch $@

# The locks, made from pyproject.toml by uv: requirements.lock, the runtime dependencies and the
# build backend (the image installs it); requirements-test.lock, those at the same versions and
# the test and docs extras (the virtualenv above installs it). A version already locked stays
# while pyproject.toml allows it; LOCK_FLAGS=--upgrade takes the newest allowed of everything,
# LOCK_FLAGS="--upgrade-package NAME" of one package.
LOCK_FLAGS ?=
COMPILE = $(BIN)/uv pip compile pyproject.toml --universal --generate-hashes --quiet \
	--custom-compile-command "make lock" $(LOCK_FLAGS)

lock:
	test -x $(BIN)/pip || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv==$(UV_VERSION)
	$(COMPILE) --group build -o requirements.lock
	$(COMPILE) --extra test --extra docs -c requirements.lock -o requirements-test.lock

demo: $(BIN)/metering
	$(BIN)/metering demo

postgres:
	@pg_isready -q -h 127.0.0.1 -p 5432 || pg_ctlcluster --skip-systemctl-redirect $(PG_VERSION) main start
	@for i in $$(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && exit 0; sleep 1; done; \
		echo "PostgreSQL is not accepting connections on 127.0.0.1:5432" >&2; exit 1

# The dashboard's browser tests drive Debian's Chromium (Playwright cannot download its own here).
chromium:
	@command -v chromium >/dev/null || { apt-get update && apt-get install -y chromium; }

# Debian's prometheus (with promtool): the alert rules' unit tests and a live scrape
# (tests/grafana/test_prometheus.py) run the real thing.
prometheus:
	@command -v promtool >/dev/null || { apt-get update && apt-get install -y prometheus; }

# kubectl for `kubectl kustomize` (offline): tests/deploy/test_kubernetes.py renders the
# manifests of deploy/kubernetes with the real kustomize.
kubectl:
	@command -v kubectl >/dev/null || { apt-get update && apt-get install -y kubectl; }

# A Java runtime for OpenAPI Generator (tests/test_generated_client.py; its jar is in the
# openapi-generator-cli wheel).
java:
	@command -v java >/dev/null || { apt-get update && apt-get install -y default-jre-headless; }

# Debian's PgBouncer (1.18) in transaction mode: tests/test_pgbouncer.py starts its own, and
# METERING_TEST_PGBOUNCER=1 puts one in front of every PostgreSQL database the tests reach.
pgbouncer:
	@command -v pgbouncer >/dev/null || PATH="$$PATH:/usr/sbin" command -v pgbouncer >/dev/null || \
		{ apt-get update && apt-get install -y pgbouncer; }

# Most of the suite runs in four processes (pytest-xdist: most tests wait on servers and
# sockets, not on the two cores; each process has its own servers and databases; an idle
# process takes tests queued for another, `--dist worksteal`), then the tests marked serial
# (tests/serial.txt: load, replicas, kills) in two processes, each with a core of its
# own, then those marked alone (a descriptor count against a deadline; the PostgreSQL restart)
# one at a time. TEST_WORKERS=0 runs the first part in this one process too; SERIAL_WORKERS=0
# the serial part.
TEST_WORKERS ?= 4
SERIAL_WORKERS ?= 2
# The serial and alone parts' files (tests/conftest.py marks the same): their pytest collects
# only these, not the whole suite again.
SERIAL_TESTS := $(shell grep -v '^\#' tests/serial.txt)
# `make test`'s PostgreSQL tests through PgBouncer (tests/conftest.py, METERING_TEST_PGBOUNCER):
# completions through the SDK, holds and settles in groups, credential invalidation across
# replicas, the migrations (tests/test_pgbouncer.py, in the first part, starts poolers of its
# own). A few tests of these files, about half a minute.
PGBOUNCER_TESTS := tests/proxy/test_e2e_completions.py tests/auth/test_credential_cache.py \
	tests/budgets/test_group_settle.py tests/test_migrations.py
PGBOUNCER_PICK := not sqlite and (sdk_completion or change_is_seen or listener_is_cut or \
	concurrent_settles or without_drift)
ALONE_TESTS := $(shell grep -v '^\#' tests/alone.txt)

test: $(BIN)/metering postgres chromium prometheus kubectl java pgbouncer
	rm -f test-output/junit-*.xml
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not serial and not alone" \
		--junitxml=test-output/junit-parallel.xml; \
		parallel=$$?; \
		METERING_TEST_PGBOUNCER=1 $(BIN)/pytest -q -n $(SERIAL_WORKERS) --dist worksteal \
		-k "$(PGBOUNCER_PICK)" $(PGBOUNCER_TESTS) --junitxml=test-output/junit-pgbouncer.xml; \
		pooled=$$?; \
		$(BIN)/pytest -q -n $(SERIAL_WORKERS) --dist worksteal -m serial $(SERIAL_TESTS) \
		--junitxml=test-output/junit-serial.xml; \
		serial=$$?; \
		$(BIN)/pytest -q -m alone $(ALONE_TESTS) --junitxml=test-output/junit-alone.xml; \
		alone=$$?; \
		test $$parallel -eq 0 -a $$pooled -eq 0 -a $$serial -eq 0 -a $$alone -eq 0

# The PostgreSQL tests through PgBouncer in transaction mode (METERING_TEST_PGBOUNCER=1:
# tests/conftest.py puts one in front of every database, with METERING_DATABASE_POOLER=pgbouncer
# and the direct URL set), the whole suite but the files tests/pgbouncer.txt leaves out, in
# the same three parts as `make test`; `make test` runs the few files PGBOUNCER_TESTS names.
PGBOUNCER_SKIP := $(shell grep -v '^\#' tests/pgbouncer.txt)
test-pgbouncer: $(BIN)/metering postgres chromium prometheus kubectl java pgbouncer
	rm -f test-output/junit-pgbouncer-*.xml
	export METERING_TEST_PGBOUNCER=1; \
		$(BIN)/pytest -q -n $(TEST_WORKERS) --dist worksteal -m "e2e and not serial and not alone" \
		$(addprefix --ignore=,$(PGBOUNCER_SKIP)) --junitxml=test-output/junit-pgbouncer-parallel.xml; \
		parallel=$$?; \
		$(BIN)/pytest -q -n $(SERIAL_WORKERS) --dist worksteal -m "e2e and serial" \
		$(filter-out $(PGBOUNCER_SKIP),$(SERIAL_TESTS)) --junitxml=test-output/junit-pgbouncer-serial.xml; \
		serial=$$?; \
		$(BIN)/pytest -q -m "e2e and alone" $(filter-out $(PGBOUNCER_SKIP),$(ALONE_TESTS)) \
		--junitxml=test-output/junit-pgbouncer-alone.xml; \
		alone=$$?; \
		test $$parallel -eq 0 -a $$serial -eq 0 -a $$alone -eq 0

# libfaketime, for the fault suite's replicas with skewed clocks (tests/faults/test_skew.py).
faketime:
	@test -e /usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1 || { apt-get update && apt-get install -y faketime; }

# The fault suite (tests/faults/, docs/operator/high-availability.md), on its own: a primary
# killed under load and its synchronous standby promoted, a replica cut from the database
# mid-request, two replicas with clocks 30 s apart; the three invariants checked after each.
# One process (each test runs its own clusters, replicas and 100 clients), a few minutes; the
# figures land in test-output/faults.json.
test-faults: $(BIN)/metering postgres faketime
	METERING_FAULT_SUITE=1 $(BIN)/pytest -q -s -n 0 tests/faults

# The client matrix (tests/clients/, docs/getting-started/clients.md): the Python and Node clients
# users bring (openai, langchain-openai, litellm, openai-agents, llm; openai and the Vercel AI SDK
# on Node), each spawned against a live server on the simulator's four dialects, on both
# databases. The Python clients have a virtualenv of their own (.venv-clients, from
# tests/clients/requirements.lock: their pins conflict with the server's, see that file), the
# Node ones `npm ci` from tests/clients/node/package-lock.json. Not in `make test` (about
# $(CLIENT_WORKERS) processes for a minute and a half): CI runs it as its own step.
CLIENTS_VENV := .venv-clients
CLIENT_WORKERS ?= 2
$(CLIENTS_VENV)/installed: tests/clients/requirements.lock | $(BIN)/metering
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(BIN)/uv pip install -q --python $(CLIENTS_VENV)/bin/python --require-hashes \
		-r tests/clients/requirements.lock
	touch $@

tests/clients/node/node_modules/.package-lock.json: tests/clients/node/package-lock.json
	cd tests/clients/node && npm ci --no-audit --no-fund

test-clients: $(BIN)/metering $(CLIENTS_VENV)/installed \
		tests/clients/node/node_modules/.package-lock.json postgres
	METERING_CLIENT_MATRIX=1 $(BIN)/pytest -q -n $(CLIENT_WORKERS) --dist load tests/clients

# The client matrix's Python lock, from tests/clients/requirements.in (as `lock` does the
# project's); the Node lock is npm's (`npm install` in tests/clients/node).
lock-clients:
	test -x $(BIN)/uv || $(MAKE) $(BIN)/metering
	$(BIN)/uv pip compile tests/clients/requirements.in --universal --python-version 3.11 --generate-hashes \
		--quiet --custom-compile-command "make lock-clients" $(LOCK_FLAGS) \
		-o tests/clients/requirements.lock

# Schemathesis over the whole API (tests/fuzz, docs/development/fuzzing.md) with a bigger budget
# than CI's: more examples an operation, longer stateful scenarios, every coverage request on
# both databases. FUZZ_EXAMPLES and FUZZ_STEPS set it.
FUZZ_EXAMPLES ?= 100
FUZZ_STEPS ?= 50
fuzz: $(BIN)/metering postgres
	FUZZ_FULL=1 FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_STEPS=$(FUZZ_STEPS) \
		$(BIN)/pytest -q -n 2 --dist worksteal tests/fuzz

# The unit tests alone (tests/conftest.py marks each test unit or e2e: a unit test starts no
# server and no database), in two processes: no PostgreSQL, no browser, under a minute.
test-fast: $(BIN)/metering
	$(BIN)/pytest -q -n 2 -m unit

lint: $(BIN)/metering
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The reference pages written from the code (scripts/reference.py): docs/operator/configuration.md
# from the settings class. tests/docs/test_reference.py fails while a committed page is stale.
reference: $(BIN)/metering
	$(BIN)/python -m scripts.reference

bench: $(BIN)/metering postgres
	$(BIN)/python -m bench.run

# The documentation site (mkdocs.yml, docs/): served with live reload on http://127.0.0.1:8000;
# `make docs-build` is CI's strict build into build/site (a broken link, a broken anchor or a
# page missing from the nav fails it). Both run offline.
docs: $(BIN)/metering
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

docs-build: $(BIN)/metering
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
