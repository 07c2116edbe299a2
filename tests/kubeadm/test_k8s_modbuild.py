"""The pure parts of the build from Go modules: the committed go.mod, the version switch, cache entries. No
root, no network, no build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet_harness.cluster import gomod
from gpufleet_harness.cluster.k8s_build import cached, ensure_k8s
from gpufleet_harness.cluster.k8s_cache import BuildError


def test_release_numbers_select_the_module_build() -> None:
    assert gomod.is_module_version("1.37.2") and gomod.is_module_version("v1.37.2")
    assert not gomod.is_module_version("1.20.5+really1.20.2-1.1+deb12u1")


def test_committed_gomod_pins_every_staging_module_to_the_release(tmp_path: Path) -> None:
    """go.mod for 1.37.2 as `go mod edit -json` reads it: kubernetes at the release, each staging module
    replaced by v0.37.2, the six programs as tools; go.sum present."""
    release = gomod.module_builds()["1.37.2"]
    assert release.etcd_version == "3.7.0"
    doc = gomod.read_gomod(release.kubernetes_dir / "go.mod", gomod.go_env(tmp_path))
    required = {r["Path"]: r["Version"] for r in doc["Require"]}
    assert required["k8s.io/kubernetes"] == "v1.37.2"
    replaced = {r["Old"]["Path"]: (r["New"]["Path"], r["New"].get("Version")) for r in doc["Replace"]}
    for module in ("k8s.io/api", "k8s.io/apiserver", "k8s.io/client-go", "k8s.io/kubelet", "k8s.io/cri-api"):
        assert replaced[module] == (module, "v0.37.2")
    assert all(version == "v0.37.2" for _, version in replaced.values()), replaced
    assert sorted(t["Path"] for t in doc["Tool"]) == sorted(
        f"k8s.io/kubernetes/cmd/{name}" for name in gomod.KUBERNETES_COMMANDS
    )
    assert [d for d in doc["GoDebug"] if d["Key"] == "default"], "the release's godebug default is kept"
    assert (release.kubernetes_dir / "go.sum").stat().st_size > 0
    etcd = gomod.read_gomod(release.etcd_dir / "go.mod", gomod.go_env(tmp_path))
    assert {r["Path"]: r["Version"] for r in etcd["Require"]}["go.etcd.io/etcd/server/v3"] == "v3.7.0"


def test_staging_replacements_come_from_the_release_gomod() -> None:
    upstream = {
        "Require": [
            {"Path": "k8s.io/api", "Version": "v0.0.0"},
            {"Path": "k8s.io/klog/v2", "Version": "v2.140.0"},
            {"Path": "k8s.io/client-go", "Version": "v0.0.0"},
        ],
        "Replace": [
            {"Old": {"Path": "k8s.io/api"}, "New": {"Path": "./staging/src/k8s.io/api"}},
            {"Old": {"Path": "k8s.io/client-go"}, "New": {"Path": "./staging/src/k8s.io/client-go"}},
            {
                "Old": {"Path": "k8s.io/sample-controller"},
                "New": {"Path": "./staging/src/k8s.io/sample-controller"},
            },
        ],
    }
    # only what the release requires (sample-controller is not: the proxy has no v0.37.2 of it)
    assert gomod.staging_replacements(upstream, "1.37.2") == {
        "k8s.io/api": "v0.37.2",
        "k8s.io/client-go": "v0.37.2",
    }


def test_unknown_release_fails_naming_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match=r"python -m gpufleet_harness.cluster.gomod 1\.36\.9"):
        ensure_k8s("1.36.9", tmp_path)
    with pytest.raises(BuildError, match=r"no complete cache entry for kubernetes 1\.37\.2"):
        ensure_k8s("1.37.2", tmp_path, build=False)


def test_module_entries_are_found_by_version_only(tmp_path: Path) -> None:
    entry = tmp_path / "k8s" / "1.37.2"
    files = ["bin/kubeadm", "bin/etcd", "images/kube-apiserver.tar"]
    for name in [
        *files,
        *(
            f"bin/{c}"
            for c in ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubelet", "kubectl")
        ),
        "images/pause.tar",
        "images/busybox.tar",
    ]:
        (entry / name).parent.mkdir(parents=True, exist_ok=True)
        (entry / name).write_text("x")
    manifest = {
        "version": "1.37.2",
        "git_version": "v1.37.2",
        "source": "go modules",
        "files": files,
        "kubeadm_images": {
            "registry.k8s.io/kube-apiserver:v1.37.2": {
                "rootfs": "images/kube-apiserver.tar",
                "changes": ["ENV PATH=/usr/local/bin"],
            }
        },
    }
    (entry / "manifest.json").write_text(json.dumps(manifest))
    found = cached("v1.37.2", tmp_path)
    assert found is not None and found.from_modules and found.git_version == "v1.37.2"
    assert found.kubeadm_images == {
        "registry.k8s.io/kube-apiserver:v1.37.2": (
            entry / "images/kube-apiserver.tar",
            ["-c", "ENV PATH=/usr/local/bin"],
        )
    }
    # the default (no version) stays the Debian-source line: a module build is only used when named
    assert cached(None, tmp_path) is None
    (entry / "bin/etcd").unlink()
    assert cached("1.37.2", tmp_path) is None, "an entry missing a file the manifest lists is incomplete"
