# gpufleet — the two commands a newcomer needs are `make lab` and `make test` (see README.md).
SHELL := /bin/bash
VENV := .venv/bin
# Tools in the venv call each other (ansible-lint runs ansible-playbook, pytest runs molecule...).
export PATH := $(CURDIR)/.venv/bin:$(PATH)

.PHONY: bootstrap lab lab-build lab-test test lint unit

bootstrap:
	@scripts/bootstrap

## The main job on the embedded default: the simulated lab fleet (docs/lab.md). `gpufleet lab up` brings up
## three podman GPU hosts with simulated GPUs, a Kubernetes control plane and a kubelet per host, and writes
## inventory/lab/hosts.yml (ansible.cfg's default inventory); site.yml converges them and ends with the
## validation report. `gpufleet lab down` removes it all.
lab: bootstrap
	$(VENV)/gpufleet lab up
	$(VENV)/ansible-playbook site.yml

## Everything CI runs: linters beside the lab's build (a cold Kubernetes build and image pulls leave a core
## to spare), then the whole test suite. Either failing fails the run (make -j waits for the other first).
## pytest -n 3: three pytest-xdist workers (docs/testing.md): the Kubernetes tests, the molecule scenarios, the
## rest; the 30 slowest tests are listed at the end. Opt-in suites (the lab test, kubeadm) are deselected.
test: bootstrap
	$(MAKE) --no-print-directory -j2 -Otarget lint lab-build
	$(VENV)/pytest -n 3 --durations=30

## The lab test (opt-in, ~15 min): `gpufleet lab up`, site.yml twice, the device plugin as systemd units and
## back, a driver rollout, `gpufleet lab down` (tests/lab/test_lab_site.py, docs/testing.md).
lab-test: bootstrap lab-build
	$(VENV)/pytest -m lab --durations=15 tests/lab/test_lab_site.py

## The Kubernetes build the tests need: 1.37.2 from its Go modules, one cache entry for the test cluster
## (`gpufleet cluster build`) and the lab (`gpufleet lab build`); GPUFLEET_K8S_VERSION=1.20 would add
## Debian's 1.20 for the cluster tests (docs/lab-cluster.md).
lab-build:
	$(VENV)/gpufleet cluster build
	$(VENV)/gpufleet lab build

lint:
	$(VENV)/ruff check src tests plugins bench validation
	$(VENV)/ansible-lint -q
	scripts/sanity

unit:
	$(VENV)/pytest -n 2 -m "not cluster and not root"
