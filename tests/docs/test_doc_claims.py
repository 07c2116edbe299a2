"""Sentences of README.md and docs/ that issue 30 (item 7) found false, held against the code
they describe."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _text(path: str) -> str:
    return " ".join((REPO / path).read_text().split())


def test_readme_first_screen_has_the_two_commands_and_says_make_must_be_there() -> None:
    readme = (REPO / "README.md").read_text()
    first = readme[: readme.index("\n---\n")]
    block = re.search(r"```sh\n(.*?)```", first, re.S)
    assert block and [line.split()[0:2] for line in block.group(1).splitlines()] == [["make", "lab"],
                                                                                     ["make", "test"]]
    assert "`make` must be there" in first and "apt-get install make" in first
    assert "python3-venv" in first


def test_readme_says_kubelets_run_on_containerd_cri_as_the_lab_does() -> None:
    from gpufleet_harness.lab import kubeadm
    from gpufleet_harness.lab.spec import DEFAULT_HOSTS, K8S_VERSION

    config = kubeadm.KubeadmCluster.kubelet_configuration()
    assert config["containerRuntimeEndpoint"].endswith("containerd.sock")
    assert config["cgroupDriver"] == "systemd"
    assert sorted({h.containerd for h in DEFAULT_HOSTS}) == ["1.6", "1.7", "2.1"]
    readme = _text("README.md")
    never = readme[readme.index("**Never run**") :].split("- **")[0]
    assert "CRI with a kubelet" not in never and "under a kubelet" not in never
    real = readme[readme.index("- **Real**") :].split("- **")[1]
    for claim in ("Debian 13's 550", "580-server", "nvidia_driver_ubuntu_dkms", f"Kubernetes {K8S_VERSION}",
                  "containerd 1.6, 1.7 and 2.1 through CRI v1"):  # fmt: skip
        assert claim in " ".join(real.split()), claim
    assert (REPO / "molecule/nvidia_driver_ubuntu_dkms/molecule.yml").is_file()


def test_cluster_help_names_the_command_that_stops_it() -> None:
    out = subprocess.run([sys.executable, "-m", "gpufleet.cli", "cluster", "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout  # fmt: skip
    text = " ".join(out.split())
    assert "gpufleet cluster down" in text and "gpufleet lab down" not in text


def test_cli_doc_points_at_docs_that_describe_lab_build_and_does_not_provision_inventory_sim() -> None:
    cli = _text("docs/cli.md")
    assert "`gpufleet lab build` (builds or finds the Kubernetes 1.37.2 binaries and images" in cli
    assert "cluster build" in _text("docs/lab-cluster.md")
    assert "inventory/sim -e gpufleet_target=gpu_nodes` runs" not in cli
    sim = yaml.safe_load((REPO / "inventory/sim/hosts.yml").read_text())
    assert "gpu_nodes" not in sim and "gpufleet_sim" in sim  # as docs/cli.md now says


def test_kubernetes_doc_agrees_with_the_extender_deployment_on_service_links() -> None:
    deployment = yaml.safe_load((REPO / "deploy/extender/deployment.yaml").read_text())
    assert deployment["spec"]["template"]["spec"]["enableServiceLinks"] is False
    assert "`deploy/extender/deployment.yaml` does not set it" not in _text("docs/kubernetes.md")


def test_roles_doc_states_the_real_ubuntu_branches() -> None:
    roles = _text("docs/roles.md")
    assert "550- and 570-server packages are now transitional shells that depend on 580-server" not in roles
    assert "550-server one that depends on 570-server" in roles
    assert "595-server (595.91.07" in roles and "615-server (615.71.09" in roles
    assert "unit-tested with a stand-in `containerd` binary only" not in roles
    example = _text("inventory/example/group_vars/all.yml")
    assert "it sets no RuntimeClass" not in example
    assert "gpufleet_kubernetes_device_plugin_runtime_class_name" in example


def test_refusals_after_the_sources_are_written_are_not_said_to_change_nothing() -> None:
    """The open-flavour and "not offered" refusals read what the package sources offer, so they come after
    python3-debian, the deb822 sources and apt's index refresh (roles/nvidia_driver/tasks/repo-Debian.yml).
    The docs used to say the run "fails before changing anything" there (audit of issue 30, gap 5)."""
    tasks = yaml.safe_load((REPO / "roles/nvidia_driver/tasks/repo-Debian.yml").read_text())
    names = [task["name"] for task in tasks]
    refusal = names.index("Fail when the requested driver version is not offered")
    for written in ("Ensure the Python library behind deb822_repository is installed",
                    "Ensure Debian's contrib, non-free and non-free-firmware components are enabled",
                    "Refresh the package index"):  # fmt: skip
        assert names.index(written) < refusal, f"{written!r} comes after the refusal now: reword the docs"
    roles_doc, readme = _text("docs/roles.md"), _text("roles/nvidia_driver/README.md")
    start = roles_doc.index("**Debian 12's open kernel modules and the security update.**")
    open_paragraph = roles_doc[start : roles_doc.index("Open modules are an explicit choice", start)]
    for text in (open_paragraph, readme[readme.index("**Debian 12's open kernel modules**") :][:900]):
        assert "fails before changing anything" not in text
        assert "fails before any driver package or pin changes (the package sources are already" in text
    assert "fails before any driver package or pin changes, naming the versions the source offers" in (
        roles_doc
    )


def test_troubleshooting_names_the_runtimes_and_kubelet_the_lab_runs() -> None:
    """The lab's kubelets (Kubernetes 1.37.2) run on containerd 1.6, 1.7 and 2.1 (docs/lab.md), and Ubuntu's
    containerd 2.2.1 is in the contract matrix; docs/troubleshooting.md still said kubelet 1.20 and that
    containerd 2.x never ran as a runtime (audit of issue 30, gap 6)."""
    from gpufleet_harness.lab.spec import DEFAULT_HOSTS, K8S_VERSION

    assert sorted({h.containerd for h in DEFAULT_HOSTS}) == ["1.6", "1.7", "2.1"]
    text = _text("docs/troubleshooting.md")
    assert "kubelet 1.20" not in text and "not as a running runtime" not in text
    assert f"containerd 1.6/1.7/2.1 under kubelet {K8S_VERSION} in the lab" in text
    assert f"1.6, 1.7 and 2.1 run as the lab's kubelets' runtimes (Kubernetes {K8S_VERSION}" in text
    assert "Ubuntu's 2.2.1 (its binary when the Ubuntu archive answers" in text
