"""inventory/example tells an operator what to set (issue 30 item 8): the WHAT YOU MUST SET blocks, the MIG
and EL/EPEL settings, and every download location the roles accept, so that an air-gapped fleet finds each
one (audit of issue 30, gap 4: the Debian security archive, the Debian 12 default driver's only source, was
missing)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "inventory/example"
HOSTS, ALL = EXAMPLE / "hosts.yml", EXAMPLE / "group_vars/all.yml"
DOWNLOAD = re.compile(r"_(mirror|url|baseurl|gpgkey)$")
# Options with a download-like name that are no download location.
NOT_DOWNLOADS = {
    "gpufleet_kubernetes_scheduler_healthz_url": "kube-scheduler's health endpoint on the control-plane host",
}
BANNER = "===== WHAT YOU MUST SET"


def _example() -> str:
    return "\n".join(p.read_text() for p in sorted(EXAMPLE.rglob("*.yml")))


def _named(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text) is not None


def _operator_roles() -> set[str]:
    """Roles a playbook runs (gpufleet_dnf, which only other roles include, is not set by an operator)."""
    text = "\n".join(p.read_text() for p in (REPO / "playbooks").glob("*.yml"))
    named = set(re.findall(r"(?:role|name):\s*(?:gpufleet\.nvidia\.)?([a-z_]+)\s*$", text, re.M))
    return {p.name for p in (REPO / "roles").iterdir() if p.name in named}


def _download_options() -> dict[str, str]:
    found = {}
    for role in sorted(_operator_roles()):
        spec = yaml.safe_load((REPO / "roles" / role / "meta/argument_specs.yml").read_text())
        for entry in spec["argument_specs"].values():
            for name in entry.get("options") or {}:
                if DOWNLOAD.search(name) and name not in NOT_DOWNLOADS:
                    found[name] = role
    return found


def test_every_download_location_the_roles_accept_is_in_the_example() -> None:
    roles = _operator_roles()
    assert {"nvidia_driver", "nvidia_cuda_toolkit", "nvidia_container_toolkit", "gpu_host_prep"} <= roles
    options = _download_options()
    assert "nvidia_driver_debian_security_mirror" in options and len(options) >= 15, sorted(options)
    example = _example()
    missing = sorted(f"{name} ({role})" for name, role in options.items() if not _named(name, example))
    assert not missing, f"download locations the example does not show: {missing}"


def test_the_air_gapped_section_says_debian_12s_driver_comes_from_the_security_archive() -> None:
    text = ALL.read_text()
    section = text[text.index("# --- Air-gapped fleets") :]
    section = section[: section.index("\n\n")]
    assert "# nvidia_driver_debian_security_mirror: http://mirror.internal/debian-security" in section
    assert "535.309.01, is only there (bookworm-security)" in " ".join(section.replace("#", " ").split())


def _banner_block(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if BANNER in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("# ======"))
    return lines[start + 1 : end]


def test_hosts_yml_starts_with_what_you_must_set() -> None:
    lines = HOSTS.read_text().splitlines()
    first_data = next(i for i, line in enumerate(lines) if line and not line.startswith(("#", "---")))
    block = _banner_block(HOSTS)
    assert lines.index(next(line for line in lines if BANNER in line)) < first_data  # before any setting
    text = " ".join(" ".join(block).replace("#", " ").split())
    must = ["gpu_nodes", "kube_control_plane", "gpufleet_kubernetes_kubeconfig",
            "gpufleet_kubernetes_device_plugin_image", "gpufleet_kubernetes_extender_image",
            "gpufleet_validation_runtime", "gpufleet_validation_cluster",
            "gpufleet_validation_suites"]  # fmt: skip
    for name in must:
        assert _named(name, text), f"hosts.yml's WHAT YOU MUST SET block does not name {name}"
    assert "NOT RUN" in text
    inventory: dict[str, Any] = yaml.safe_load(HOSTS.read_text())["all"]["children"]
    assert inventory["gpu_nodes"]["hosts"] and inventory["kube_control_plane"]["hosts"]


def test_group_vars_all_starts_with_the_settings_it_says_to_replace() -> None:
    text = ALL.read_text()
    assert text.index(BANNER) < min(m.start() for m in re.finditer(r"^[a-z]", text, re.M))
    block: dict[str, Any] = yaml.safe_load("\n".join(_banner_block(ALL)))
    assert sorted(block) == sorted([
        "gpufleet_kubernetes_kubeconfig", "gpufleet_kubernetes_device_plugin_image",
        "gpufleet_kubernetes_extender_image", "gpufleet_validation_runtime",
        "gpufleet_validation_runtime_image", "gpufleet_validation_cluster",
    ])  # fmt: skip
    assert block["gpufleet_validation_runtime"] in ("docker", "containerd")
    cluster = block["gpufleet_validation_cluster"]
    assert cluster["kubeconfig"] and cluster["workload"]["image"]
    assert all("example" in str(block[k]) for k in block if k.endswith("_image")), block


def test_the_example_names_the_mig_and_el_settings() -> None:
    example = _example()
    for name in ("gpufleet_mig_enabled", "nvidia_mig_layout", "nvidia_mig_config", "gpu_host_prep_epel",
                 "gpu_host_prep_epel_baseurl", "gpu_host_prep_epel_gpgkey", "gpu_host_prep_el_crb",
                 "nvidia_driver_rhel_repo_url", "nvidia_driver_rhel_key_url",
                 "nvidia_container_toolkit_rpm_repo_url"):  # fmt: skip
        assert _named(name, example), name
