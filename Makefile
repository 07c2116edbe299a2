# gpufleet — the two commands a newcomer needs are `make lab` and `make test` (see README.md).
SHELL := /bin/bash
VENV := .venv/bin
# Tools in the venv call each other (ansible-lint runs ansible-playbook, pytest runs molecule...).
export PATH := $(CURDIR)/.venv/bin:$(PATH)

.PHONY: bootstrap lab test lint unit

bootstrap:
	@scripts/bootstrap

## The main job on the embedded default: the simulated lab fleet.
SIM_FIXTURES := dgx-a100 hgx-h100 pcie-2x-t4 esxi-vm-2x-v100 node-40-gpus
lab: bootstrap
	@for f in $(SIM_FIXTURES); do $(VENV)/gpufleet sim materialize $$f .lab/sim/$$f >/dev/null || exit 1; done
	@# The simulated machines run on this one (connection local): they report facts, and the
	@# provisioning stages target a group they are not in, so nothing is installed here.
	$(VENV)/ansible-playbook -i inventory/sim -e gpufleet_target=gpu_nodes site.yml
	@# Then the host validation suite over the simulated fleet, with its report.
	$(VENV)/ansible-playbook -i inventory/sim -e gpufleet_validation_suites=host playbooks/validate.yml

## Everything CI runs: linters, then the whole test suite.
test: bootstrap lint
	$(VENV)/gpufleet lab build
	$(VENV)/pytest

lint:
	$(VENV)/ruff check src tests plugins bench validation
	$(VENV)/ansible-lint -q
	scripts/sanity

unit:
	$(VENV)/pytest -m "not cluster and not root"
