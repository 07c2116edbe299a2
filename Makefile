# gpufleet — the two commands a newcomer needs are `make lab` and `make test` (see README.md).
SHELL := /bin/bash
VENV := .venv/bin
# Tools in the venv call each other (ansible-lint runs ansible-playbook, pytest runs molecule...).
export PATH := $(CURDIR)/.venv/bin:$(PATH)

.PHONY: bootstrap lab test lint unit

bootstrap:
	@scripts/bootstrap

## The main job on the embedded default: the simulated lab fleet (docs/lab.md). `gpufleet lab up` brings up
## three podman GPU hosts with simulated GPUs, a Kubernetes control plane and a kubelet per host, and writes
## inventory/lab/hosts.yml (ansible.cfg's default inventory); site.yml converges them and ends with the
## validation report. `gpufleet lab down` removes it all.
lab: bootstrap
	$(VENV)/gpufleet lab up
	$(VENV)/ansible-playbook site.yml

## Everything CI runs: linters, then the whole test suite.
## pytest -n 3: three pytest-xdist workers (docs/testing.md): the lab tests, the molecule scenarios, the rest.
test: bootstrap lint
	$(VENV)/gpufleet lab build
	$(VENV)/pytest -n 3

lint:
	$(VENV)/ruff check src tests plugins bench validation
	$(VENV)/ansible-lint -q
	scripts/sanity

unit:
	$(VENV)/pytest -n 2 -m "not cluster and not root"
