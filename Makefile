# gpufleet — the two commands a newcomer needs are `make lab` and `make test` (see README.md).
SHELL := /bin/bash
VENV := .venv/bin

.PHONY: bootstrap lab test lint unit

bootstrap:
	@scripts/bootstrap

## The main job on the embedded default: the simulated lab fleet.
lab: bootstrap
	$(VENV)/gpufleet lab run

## Everything CI runs: linters, then the whole test suite.
test: bootstrap lint
	$(VENV)/pytest

lint:
	$(VENV)/ruff check src tests plugins bench
	$(VENV)/ansible-lint --profile production --offline -q

unit:
	$(VENV)/pytest -m "not cluster and not root"
