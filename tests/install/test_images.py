"""The service images as an operator gets them: `gpufleet release images` (podman, no registry, nothing
pulled), the images themselves (podman runs them), and role gpufleet_images (playbooks/images.yml) putting
them into a real containerd's k8s.io namespace, a real dockerd, or a real registry (Debian's docker-registry),
with each runtime private to the test (docs/install.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from daemons import Containerd, containerd, dockerd, registry
from kubernetes import client as k8s
from modargs import kubernetes_yml

from gpufleet import ociarchive
from gpufleet_harness.cluster.process import free_ports
from gpufleet_harness.release import images
from gpufleet_harness.testhosts.podman import podman_env

if TYPE_CHECKING:
    from labstack import LabStack

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("images")
    images.build(out)
    return out, json.loads((out / "images.json").read_text())


def _playbook(tmp: Path, node: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    """playbooks/images.yml on one GPU node that is this machine (connection local)."""
    inventory = tmp / f"hosts-{uuid.uuid4().hex[:6]}.yml"
    host = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_become": False,  # root already, and no sudo on this machine
        "gpufleet_images_node_dir": str(tmp / "node-dir"),
        **node,
    }
    inventory.write_text(yaml.safe_dump({"all": {"children": {"gpu_nodes": {"hosts": {"node-a": host}}}}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")} | {"ANSIBLE_NOCOLOR": "1"}
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), "playbooks/images.yml", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _recap(proc: subprocess.CompletedProcess[str]) -> dict[str, int]:
    match = re.search(r"node-a\s+:\s+(.*)", proc.stdout)
    assert match, proc.stdout[-3000:] + proc.stderr[-2000:]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", match.group(1))}


def _explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"rc {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"


def test_images_are_reproducible_small_and_named_in_images_json(
    built: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out, doc = built
    assert set(doc["images"]) == {"device-plugin", "extender"}
    for name, entry in doc["images"].items():
        image = ociarchive.read(str(out / entry["archive"]))
        assert (image.name, image.digest, image.image_id) == (entry["name"], entry["digest"], entry["id"])
        assert image.name == f"docker.io/gpufleet/{name}:{images.gpufleet.__version__}"
    # sizes as shipped (gzip layers): Debian minbase + python3, and for the plugin the kubernetes client
    assert doc["images"]["extender"]["size"] < 80 * 2**20
    assert doc["images"]["device-plugin"]["size"] < 100 * 2**20
    configs = {
        n: json.loads(ociarchive.read(str(out / e["archive"])).config_bytes) for n, e in doc["images"].items()
    }
    assert configs["extender"]["config"]["User"] == "65532:65532"
    assert configs["extender"]["config"]["Entrypoint"] == ["gpufleet-extender"]
    assert configs["device-plugin"]["config"]["Entrypoint"] == ["gpufleet-device-plugin"]
    assert configs["extender"]["created"] == "1970-01-01T00:00:00Z"

    # the same inputs, built again without any cache, give the same bytes (and so the same digests)
    service = images.SERVICES["extender"]
    base_tag, _ = images.ensure_base({})
    again = tmp_path / "again.oci.tar"
    images.build_archive(
        service, base_tag, again, {}, f"localhost/gpufleet-test/extender:{uuid.uuid4().hex[:8]}"
    )
    assert again.read_bytes() == (out / doc["images"]["extender"]["archive"]).read_bytes()


def test_the_images_run_their_service_the_extender_not_as_root(built: tuple[Path, dict[str, Any]]) -> None:
    out, doc = built
    env = podman_env()
    loaded = []
    try:
        for entry in doc["images"].values():
            subprocess.run(
                ["podman", "load", "-q", "-i", str(out / entry["archive"])],
                env=env,
                check=True,
                capture_output=True,
            )
            loaded.append(entry["id"])

        def run(image_id: str, *argv: str, entrypoint: str | None = None) -> str:
            cmd = [
                "podman",
                "run",
                "--rm",
                "--network=none",
                *(["--entrypoint", entrypoint] if entrypoint else []),
            ]
            proc = subprocess.run(
                [*cmd, image_id, *argv], env=env, capture_output=True, text=True, check=False
            )
            assert proc.returncode == 0, proc.stderr
            return proc.stdout

        ext, dp = doc["images"]["extender"]["id"], doc["images"]["device-plugin"]["id"]
        assert "usage: gpufleet-extender" in run(ext, "--help")
        assert run(ext, "-u", entrypoint="id").strip() == "65532"
        # every extender module imports with only what the image carries
        walk = (
            "import importlib, pkgutil, gpufleet.extender as e\n"
            "names = [m.name for m in pkgutil.walk_packages(e.__path__, 'gpufleet.extender.')"
            " if not m.name.endswith('__main__')]\n"
            "[importlib.import_module(n) for n in names]\nprint(len(names))"
        )
        assert int(run(ext, "-c", walk, entrypoint="python3")) > 10
        # serve's API client comes from the kubernetes client's loaders (no service account, no kubeconfig)
        load = (
            "from gpufleet.extender.kube import KubeCluster\ntry:\n    KubeCluster.from_config('')\n"
            "except Exception as exc:\n    print(type(exc).__module__, type(exc).__name__)"
        )
        assert run(ext, "-c", load, entrypoint="python3").split() == [
            "kubernetes.config.config_exception",
            "ConfigException",
        ]
        assert "usage: gpufleet-device-plugin" in run(dp, "--help")
        assert (
            run(
                dp,
                "-c",
                "import gpufleet.deviceplugin.app, grpc, pynvml, kubernetes.client; print('ok')",
                entrypoint="python3",
            ).strip()
            == "ok"
        )
    finally:
        for image_id in loaded:
            subprocess.run(["podman", "rmi", "-f", image_id], env=env, capture_output=True, check=False)


def test_containerd_gets_each_image_once_and_bad_input_changes_no_node(
    built: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out, doc = built
    with containerd() as ctd:
        node = {
            "gpufleet_images_dir": str(out),
            "gpufleet_images_runtime": "containerd",
            "gpufleet_images_containerd_address": ctd.address,
        }
        # bad input first, on a node with no image: each fails before the node is touched
        wrong = {"extender": "sha256:" + "0" * 64}
        refused = _playbook(tmp_path, node, "-e", json.dumps({"gpufleet_images_expected_digests": wrong}))
        assert refused.returncode != 0
        assert f"the extender image in {out}/gpufleet-extender-0.1.0.oci.tar has digest " in refused.stdout
        assert "refusing it" in refused.stdout
        partial = tmp_path / "partial"
        shutil.copytree(out, partial)
        (partial / doc["images"]["extender"]["archive"]).unlink()
        missing = _playbook(tmp_path, {**node, "gpufleet_images_dir": str(partial)})
        assert missing.returncode != 0 and "the extender image's archive is unusable" in missing.stdout
        assert "does not exist" in missing.stdout
        unset = _playbook(tmp_path, {**node, "gpufleet_images_dir": ""})
        assert unset.returncode != 0 and "gpufleet_images_dir is not set" in unset.stdout
        assert ctd.images() == {} and not (tmp_path / "node-dir").exists()

        check = _playbook(tmp_path, node, "--check")
        assert check.returncode == 0, _explain(check)
        assert _recap(check)["changed"] >= 2 and ctd.images() == {}

        first = _playbook(tmp_path, node)
        assert first.returncode == 0, _explain(first)
        assert _recap(first)["changed"] >= 3
        held = ctd.images()
        for entry in doc["images"].values():
            repository = ociarchive.repository(entry["name"])
            assert held[entry["name"]] == entry["digest"]
            assert (
                held[f"{repository}@{entry['digest']}"] == entry["digest"]
            )  # the name a digest reference finds
        assert not (tmp_path / "node-dir").exists()  # the copied archives are gone

        second = _playbook(tmp_path, node)
        assert second.returncode == 0, _explain(second)
        assert (
            _recap(second)["changed"] == 0 and "Copy the archives" not in second.stdout.split("skipping")[0]
        )
        assert ctd.images() == held


def test_docker_loads_the_same_archive_under_the_same_image_id(
    built: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out, doc = built
    with dockerd() as docker:
        node = {
            "gpufleet_images_dir": str(out),
            "gpufleet_images_runtime": "docker",
            "gpufleet_images_docker_host": docker.host,
        }
        first = _playbook(tmp_path, node)
        assert first.returncode == 0, _explain(first)
        for entry in doc["images"].values():
            assert docker.image_id(entry["id"]) == entry["id"]
            assert docker.image_id(entry["name"].removeprefix("docker.io/")) == entry["id"]
        second = _playbook(tmp_path, node)
        assert second.returncode == 0 and _recap(second)["changed"] == 0, _explain(second)


def test_a_registry_gets_the_images_pushed_once_and_an_unreachable_one_is_named(
    built: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out, doc = built
    with registry() as reg:
        node = {
            "gpufleet_images_dir": str(out),
            "gpufleet_images_registry": f"{reg.address}/site",
            "gpufleet_images_registry_scheme": "http",
        }
        first = _playbook(tmp_path, node)
        assert first.returncode == 0, _explain(first)
        assert _recap(first)["changed"] == 1  # the push; nothing on the node
        assert sorted(reg.catalog()) == ["site/gpufleet/device-plugin", "site/gpufleet/extender"]
        for name, entry in doc["images"].items():
            assert reg.manifest_digest(f"site/gpufleet/{name}", "0.1.0") == entry["digest"]
        second = _playbook(tmp_path, node)
        assert second.returncode == 0 and _recap(second)["changed"] == 0, _explain(second)

    (closed,) = free_ports(1)
    gone = _playbook(tmp_path, {**node, "gpufleet_images_registry": f"127.0.0.1:{closed}"})
    assert gone.returncode != 0
    digest = doc["images"]["device-plugin"]["digest"]
    assert f"the device-plugin image (127.0.0.1:{closed}/gpufleet/device-plugin@{digest})" in gone.stdout
    assert "cannot reach the registry" in gone.stdout


def _config_digest(ctd: Containerd, manifest_digest: str) -> str:
    """The config digest (what the kubelet's CRI calls the image ID) of a manifest in containerd's content."""
    blob = subprocess.run(
        [ctd.ctr, "--address", ctd.address, "--namespace", "k8s.io", "content", "get", manifest_digest],
        capture_output=True,
        check=True,
    ).stdout
    return str(json.loads(blob)["config"]["digest"])


def test_kubernetes_yml_deploys_the_workloads_by_the_refs_images_json_gives(
    built: tuple[Path, dict[str, Any]], stack: LabStack, tmp_path: Path
) -> None:
    """The handoff images.json -> role gpufleet_images (image_archive, no registry: imported into a real
    containerd's k8s.io) -> role gpufleet_kubernetes -> the DaemonSet and the Deployment read back from a real
    API server name each image by the image ID images.json gives, never by a tag (issue 34 audit, gap G6).
    The pods are not waited for (gpufleet_kubernetes_wait false): no kubelet runs here; tests/cluster's
    test_service_images_kubelet.py shows a kubelet runs pods by such an ID."""
    out, doc = built
    cp = stack.control_plane
    suffix = uuid.uuid4().hex[:6]
    namespace, plugin, extender = f"gpufleet-digest-{suffix}", f"gf-dp-{suffix}", f"gf-ext-{suffix}"
    apps = k8s.AppsV1Api(cp.api_client())
    with containerd() as ctd:
        node = {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "ansible_become": False,  # root already
            "gpufleet_expected_gpu_count": 8,
            "gpufleet_images_node_dir": str(tmp_path / "node-dir"),
            "gpufleet_images_runtime": "containerd",
            "gpufleet_images_containerd_address": ctd.address,
        }
        settings = {
            "gpufleet_images_dir": str(out),
            "gpufleet_kubernetes_kubeconfig": str(cp.kubeconfig()),
            "gpufleet_kubernetes_namespace": namespace,
            "gpufleet_kubernetes_device_plugin_name": plugin,
            "gpufleet_kubernetes_extender_name": extender,
            "gpufleet_kubernetes_extender_service_type": "ClusterIP",
            "gpufleet_kubernetes_runtime_class_name": "",
            "gpufleet_kubernetes_configure_scheduler": False,
            "gpufleet_kubernetes_wait": False,
        }
        hosts = {"gpu-a": node, "gpu-b": node | {"gpufleet_images_node_dir": str(tmp_path / "node-dir-b")}}
        inventory = tmp_path / "hosts.yml"
        inventory.write_text(
            # two GPU nodes: without a registry both workloads are kept to them, a node affinity the real API
            # server must accept (one value per matchFields requirement: it refused a list of two in the lab)
            yaml.safe_dump({"all": {"vars": settings, "children": {"gpu_nodes": {"hosts": hosts}}}})
        )

        try:
            deployed = kubernetes_yml(inventory, timeout=600)
            assert deployed.returncode == 0, _explain(deployed)
            refs = {name: entry["id"] for name, entry in doc["images"].items()}
            for ref in refs.values():
                assert re.fullmatch(r"sha256:[0-9a-f]{64}", ref), ref
            # each ref names the image the node's runtime now holds
            held = ctd.images()
            for name, entry in doc["images"].items():
                assert held[entry["name"]] == entry["digest"]
                assert _config_digest(ctd, entry["digest"]) == refs[name]

            daemon_set = apps.read_namespaced_daemon_set(plugin, namespace).spec.template.spec
            deployment = apps.read_namespaced_deployment(extender, namespace).spec.template.spec
            for spec, name in ((daemon_set, "device-plugin"), (deployment, "extender")):
                containers = [*(spec.init_containers or []), *spec.containers]
                assert {c.image for c in containers} == {refs[name]}, (name, [c.image for c in containers])
                terms = spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
                pinned = [f.values for t in terms.node_selector_terms for f in t.match_fields]
                assert pinned == [["gpu-a"], ["gpu-b"]], (name, pinned)
        finally:
            # waited for this time: the namespace is gone when the run ends
            gone = kubernetes_yml(
                inventory,
                "-e",
                "gpufleet_kubernetes_state=absent",
                "-e",
                "gpufleet_kubernetes_wait=true",
                timeout=600,
            )
            assert gone.returncode == 0, _explain(gone)
    assert namespace not in {n.metadata.name for n in cp.core_v1().list_namespace().items}
