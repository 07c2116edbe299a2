#!/usr/bin/python
# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Ansible module: check gpufleet's image archives on the controller, name the references manifests use, and
push them to a registry when one is given."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: image_archive
short_description: Check gpufleet's service image archives, give their references, push them to a registry
version_added: "0.1.0"
description:
  - Reads the directory C(gpufleet release images) writes (C(images.json) and one OCI archive per image) on the
    machine it runs on (the controller), checks each archive asked for in O(names) (every blob against its
    digest, the manifest digest against C(images.json) or O(expected_digests)) and returns the reference
    Kubernetes manifests should use for each.
  - Without O(registry), the reference is the image ID (C(sha256:...), the digest of the image's configuration,
    which names every layer by the digest of its content); containerd's CRI and docker both find an image
    imported from an archive by it (docker keeps no repository digest for a loaded image).
    M(gpufleet.nvidia.container_image) imports the archives on the nodes.
  - With O(registry), the reference is C(<registry>/gpufleet/<name>@<manifest digest>). The registry is pinged
    first; with O(push) the images are pushed (blobs the registry has are not sent again; an image whose
    manifest is there already is unchanged).
  - Fails naming the image when its archive is missing or damaged, its digest is not the one expected, or the
    registry cannot be reached.
author:
  - gpufleet contributors (@gpufleet)
options:
  images_dir:
    description: The directory with C(images.json) and the archives (C(OUT/images) of C(gpufleet release images --out OUT)).
    type: path
    required: true
  names:
    description: The images wanted (C(device-plugin), C(extender)).
    type: list
    elements: str
    required: true
  expected_digests:
    description: Manifest digests the archives must have, by image name; those not given come from C(images.json).
    type: dict
    default: {}
  registry:
    description: C(host[:port][/path]) of a registry to use instead of archives on the nodes; empty for none.
    type: str
    default: ""
  registry_scheme:
    description: How the registry is reached.
    type: str
    choices: [https, http]
    default: https
  registry_username:
    description: User for HTTP basic authentication or the registry's token service; empty for none.
    type: str
    default: ""
  registry_password:
    description: Its password or token.
    type: str
    default: ""
  registry_ca_file:
    description: CA bundle that signed the registry's certificate; empty for the system's.
    type: path
  validate_certs:
    description: Verify the registry's certificate.
    type: bool
    default: true
  push:
    description: Push the images to O(registry) (otherwise only ping it).
    type: bool
    default: false
attributes:
  check_mode:
    description: Reads and checks; a push is reported, not made.
    support: full
  diff_mode:
    description: No diff.
    support: none
"""

EXAMPLES = r"""
- name: Check the images and push them to the site registry
  gpufleet.nvidia.image_archive:
    images_dir: /srv/gpufleet/images
    names: [device-plugin, extender]
    registry: registry.example.com:5000
    push: true
  register: gpufleet_images_found
  delegate_to: localhost
  run_once: true
"""

RETURN = r"""
images:
  description: Per image name, what the archive holds and the reference to deploy.
  type: dict
  returned: always
  sample:
    device-plugin:
      archive: /srv/gpufleet/images/gpufleet-device-plugin-0.1.0.oci.tar
      name: docker.io/gpufleet/device-plugin:0.1.0
      digest: sha256:3b1f...
      image_id: sha256:9c4e...
      ref: sha256:9c4e...
      pushed: false
"""

import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.nvidia.plugins.module_utils.image_registry import (
    Registry,
    RegistryError,
    push,
    split_registry,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.ociarchive import ArchiveError, read, repository

# the command that builds them writes OUT/images, the directory gpufleet_images_dir names
HOW_TO_BUILD = (
    "build them with `gpufleet release images --out OUT` in a gpufleet checkout and set "
    "gpufleet_images_dir=OUT/images (docs/install.md)"
)


def _catalog(module: AnsibleModule, images_dir: str, names: list) -> dict:
    path = os.path.join(images_dir, "images.json")
    try:
        with open(path) as handle:
            doc = json.load(handle)
    except FileNotFoundError:
        module.fail_json(
            msg=f"gpufleet images: {path} does not exist (gpufleet_images_dir={images_dir}), so the "
            f"{' and '.join(names)} image(s) cannot be checked; {HOW_TO_BUILD}"
        )
    except (OSError, ValueError) as exc:
        module.fail_json(msg=f"gpufleet images: cannot read {path}: {exc}")
    images = doc.get("images") if isinstance(doc, dict) else None
    if not isinstance(images, dict):
        module.fail_json(
            msg=f"gpufleet images: {path} has no 'images' mapping (not written by gpufleet release)"
        )
    return images


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            images_dir=dict(type="path", required=True),
            names=dict(type="list", elements="str", required=True),
            expected_digests=dict(type="dict", default={}),
            registry=dict(type="str", default=""),
            registry_scheme=dict(type="str", choices=["https", "http"], default="https"),
            registry_username=dict(type="str", default=""),
            registry_password=dict(type="str", default="", no_log=True),
            registry_ca_file=dict(type="path"),
            validate_certs=dict(type="bool", default=True),
            push=dict(type="bool", default=False),
        ),
        supports_check_mode=True,
    )
    params = module.params
    catalog = _catalog(module, params["images_dir"], params["names"])
    found: dict[str, dict] = {}
    for name in params["names"]:
        entry = catalog.get(name)
        if not isinstance(entry, dict) or not entry.get("archive"):
            module.fail_json(
                msg=f"gpufleet images: the {name} image is not in {params['images_dir']}/images.json "
                f"(it lists {', '.join(sorted(catalog)) or 'none'}); {HOW_TO_BUILD}"
            )
        path = os.path.join(params["images_dir"], entry["archive"])
        try:
            image = read(path)
        except ArchiveError as exc:
            module.fail_json(
                msg=f"gpufleet images: the {name} image's archive is unusable: {exc}; {HOW_TO_BUILD}"
            )
        expected = params["expected_digests"].get(name) or entry.get("digest")
        if image.digest != expected:
            where = (
                "expected_digests (gpufleet_images_expected_digests)"
                if params["expected_digests"].get(name)
                else "images.json"
            )
            module.fail_json(
                msg=f"gpufleet images: the {name} image in {path} has digest {image.digest}, but "
                f"{where} expects {expected}; refusing it"
            )
        found[name] = {
            "archive": path,
            "name": image.name,
            "digest": image.digest,
            "image_id": image.image_id,
            "ref": image.image_id,
            "pushed": False,
        }
        found[name]["_image"] = image
    changed = False
    if params["registry"]:
        try:
            host, prefix = split_registry(params["registry"])
            registry = Registry(
                host,
                scheme=params["registry_scheme"],
                username=params["registry_username"],
                password=params["registry_password"],
                ca_file=params["registry_ca_file"],
                validate_certs=params["validate_certs"],
            )
        except RegistryError as exc:
            module.fail_json(msg=f"gpufleet images: {exc}")
        for name, info in found.items():
            image = info["_image"]
            target = "/".join(filter(None, [prefix, repository(image.name).split("/", 1)[1]]))
            info["ref"] = f"{host}/{target}@{image.digest}"
            try:
                registry.ping()
                if params["push"]:
                    info["pushed"] = push(
                        registry, target, image.name.rsplit(":", 1)[1], image, module.check_mode
                    )
                    changed = changed or info["pushed"]
            except RegistryError as exc:
                module.fail_json(msg=f"gpufleet images: the {name} image ({info['ref']}): {exc}")
    for info in found.values():
        info.pop("_image")
    module.exit_json(changed=changed, images=found)


if __name__ == "__main__":
    main()
