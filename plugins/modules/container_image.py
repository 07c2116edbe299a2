#!/usr/bin/python
# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Ansible module: an image from an OCI archive in a node's container runtime (containerd's k8s.io namespace,
or docker), imported only where it is missing."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: container_image
short_description: Import an image archive into a node's containerd (namespace k8s.io) or docker
version_added: "0.1.0"
description:
  - Looks for the image in each runtime of O(runtime), containerd (C(ctr -n k8s.io images ls), the namespace
    where the kubelet's CRI finds images) and docker (C(docker image inspect)). An image counts as present when
    the runtime holds it under the expected image ID (docker) or manifest digest (containerd).
  - With O(state=present) and an O(archive) on the node, imports it where missing (C(ctr images import), which
    names it by tag and by digest; C(docker load)) and checks afterwards that the runtime holds the expected
    image. With O(state=query) (or no archive) only reports.
  - A second run where every runtime has the image imports nothing and reports no change.
author:
  - gpufleet contributors (@gpufleet)
options:
  name:
    description: The image's tagged name, as the archive names it (C(docker.io/gpufleet/device-plugin:0.1.0)).
    type: str
    required: true
  digest:
    description: Its manifest digest.
    type: str
    required: true
  image_id:
    description: Its image ID (the configuration's digest), what pods name it by without a registry.
    type: str
    required: true
  archive:
    description: Path of the archive on the node; needed only where the image is missing.
    type: path
  runtime:
    description: C(containerd), C(docker), or C(auto) (each of the two that answers on the node).
    type: str
    choices: [auto, containerd, docker]
    default: auto
  containerd_address:
    description: containerd's socket.
    type: path
    default: /run/containerd/containerd.sock
  containerd_namespace:
    description: containerd namespace (the CRI plugin's is C(k8s.io)).
    type: str
    default: k8s.io
  docker_host:
    description: Docker daemon socket (C(DOCKER_HOST)); empty for docker's default.
    type: str
    default: ""
  state:
    description: C(present) imports where missing; C(query) only reports.
    type: str
    choices: [present, query]
    default: present
attributes:
  check_mode:
    description: Reports what it would import.
    support: full
  diff_mode:
    description: No diff.
    support: none
"""

EXAMPLES = r"""
- name: Import the device plugin image where the node's runtime lacks it
  gpufleet.nvidia.container_image:
    name: docker.io/gpufleet/device-plugin:0.1.0
    digest: sha256:3b1f...
    image_id: sha256:9c4e...
    archive: /var/tmp/gpufleet-images/gpufleet-device-plugin-0.1.0.oci.tar
"""

RETURN = r"""
runtimes:
  description: The runtimes looked at.
  type: list
  elements: str
  returned: always
present:
  description: Per runtime, whether it held the image before this run.
  type: dict
  returned: always
  sample: {containerd: false}
missing:
  description: Whether some runtime lacked the image before this run.
  type: bool
  returned: always
imported:
  description: The runtimes the image was imported into.
  type: list
  elements: str
  returned: always
"""

import os

from ansible.module_utils.basic import AnsibleModule


def _repository(name: str) -> str:
    base = name.split("@", 1)[0]
    slash, colon = base.rfind("/"), base.rfind(":")
    return base[:colon] if colon > slash else base


class Runtime:
    def __init__(self, module: AnsibleModule) -> None:
        self.module = module
        self.params = module.params

    def run(self, argv: list[str], what: str, env: dict[str, str] | None = None) -> str:
        rc, out, err = self.module.run_command(argv, environ_update=env or {})
        if rc != 0:
            self.module.fail_json(
                msg=f"{what}: {' '.join(argv[:6])} ... exited {rc}: {(err or out).strip()[-800:]}"
            )
        return out


class Containerd(Runtime):
    label = "containerd"

    def available(self) -> bool:
        return bool(self.module.get_bin_path("ctr")) and os.path.exists(self.params["containerd_address"])

    def _ctr(self) -> list[str]:
        return [
            self.module.get_bin_path("ctr", required=True),
            "--address",
            self.params["containerd_address"],
            "--namespace",
            self.params["containerd_namespace"],
        ]

    def present(self) -> bool:
        out = self.run([*self._ctr(), "images", "ls"], "containerd: listing images")
        wanted = {
            self.params["name"]: self.params["digest"],
            f"{_repository(self.params['name'])}@{self.params['digest']}": self.params["digest"],
        }
        seen = {}
        for line in out.splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 3:
                seen[fields[0]] = fields[2]
        return all(seen.get(ref) == digest for ref, digest in wanted.items())

    def load(self, archive: str) -> None:
        self.run([*self._ctr(), "images", "import", archive], f"containerd: importing {archive}")


class Docker(Runtime):
    label = "docker"

    def _env(self) -> dict[str, str]:
        return {"DOCKER_HOST": self.params["docker_host"]} if self.params["docker_host"] else {}

    def available(self) -> bool:
        if not self.module.get_bin_path("docker"):
            return False
        rc, _out, _err = self.module.run_command(
            [self.module.get_bin_path("docker"), "version", "--format", "{{.Server.Version}}"],
            environ_update=self._env(),
        )
        return rc == 0

    def present(self) -> bool:
        docker = self.module.get_bin_path("docker", required=True)
        rc, out, _err = self.module.run_command(
            [docker, "image", "inspect", "--format", "{{.Id}}", self.params["image_id"]],
            environ_update=self._env(),
        )
        return rc == 0 and out.strip() == self.params["image_id"]

    def load(self, archive: str) -> None:
        docker = self.module.get_bin_path("docker", required=True)
        self.run([docker, "load", "--input", archive], f"docker: loading {archive}", self._env())


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            name=dict(type="str", required=True),
            digest=dict(type="str", required=True),
            image_id=dict(type="str", required=True),
            archive=dict(type="path"),
            runtime=dict(type="str", choices=["auto", "containerd", "docker"], default="auto"),
            containerd_address=dict(type="path", default="/run/containerd/containerd.sock"),
            containerd_namespace=dict(type="str", default="k8s.io"),
            docker_host=dict(type="str", default=""),
            state=dict(type="str", choices=["present", "query"], default="present"),
        ),
        supports_check_mode=True,
    )
    params = module.params
    candidates = [Containerd(module), Docker(module)]
    if params["runtime"] == "auto":
        runtimes = [r for r in candidates if r.available()]
        if not runtimes:
            module.fail_json(
                msg=f"no container runtime answers on this node (containerd at "
                f"{params['containerd_address']} with ctr, or docker); set gpufleet_images_runtime"
            )
    else:
        runtimes = [r for r in candidates if r.label == params["runtime"]]
        if not runtimes[0].available():
            module.fail_json(
                msg=f"{params['runtime']} does not answer on this node (gpufleet_images_runtime)"
            )
    present = {r.label: r.present() for r in runtimes}
    missing = [r for r in runtimes if not present[r.label]]
    result = {
        "runtimes": [r.label for r in runtimes],
        "present": present,
        "missing": bool(missing),
        "imported": [],
    }
    if not missing or params["state"] == "query":
        module.exit_json(changed=False, **result)
    if module.check_mode:
        module.exit_json(changed=True, **result)
    if not params["archive"] or not os.path.isfile(params["archive"]):
        module.fail_json(
            msg=f"{params['name']} is missing from {', '.join(r.label for r in missing)} and the "
            f"archive {params['archive']} is not on the node",
            **result,
        )
    for runtime in missing:
        runtime.load(params["archive"])
        if not runtime.present():
            module.fail_json(
                msg=f"{runtime.label}: after importing {params['archive']}, {params['name']} is not "
                f"there as {params['digest']} / {params['image_id']}: the archive is not the "
                "image expected; refusing it",
                **result,
            )
        result["imported"].append(runtime.label)
    module.exit_json(changed=True, **result)


if __name__ == "__main__":
    main()
