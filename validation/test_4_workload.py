"""Workload suite: GPU pods get exactly their GPUs.

- On every whole-GPU host: a pod with ``nvidia.com/gpu: 1`` lists exactly one GPU with nvidia-smi and has
  exactly one ``/dev/nvidia<N>`` (isolation, as in the T4 example of the seeds).
- On hosts expected to have NVLink (``nvlink: true``): a pod with 2 GPUs gets two GPUs joined by NVLink.
- On hosts that share GPU memory (``sharing: memory``): a pod asking for ``gpufleet.io/gpu-mem`` there lands
  on the node the scheduler extender recorded in its ``gpufleet.io/assignment`` and sees that GPU, only.
- On time-sliced hosts (``sharing: time-slicing``): one pod more than the host has GPUs, each asking for one
  device and all running at once, each see exactly one GPU, so two of them share one.
- On hosts whose device plugin serves MIG devices under the mixed strategy (``mig_strategy: mixed``): the
  node advertises some ``nvidia.com/mig-<profile>``, and for each, a pod asking for one sees exactly one MIG
  device of that profile (``nvidia-smi -L``), under one GPU with one ``/dev/nvidia<N>``, and the memory the
  profile names (nvidia-smi's MIG devices table: within 85-100 % of the profile's nominal GB, as 1g.10gb has
  9,728 MiB on an A100-80GB).
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from hostcheck import Target
from podcheck import Cluster, PodRun

SUITE = "workload"


def _node_name(target: Target) -> str:
    return str(target.want("node_name") or target.name)


def _ran(target_name: str, run: PodRun, what: str) -> None:
    assert run.phase == "Succeeded", f"{target_name}: {what} pod {run.name} did not run: {run.problem}"
    assert "== rc 0" in run.log, (
        f"{target_name}: nvidia-smi -L failed in {what} pod {run.name}: {run.log[-300:]}"
    )


def _on(target: Target) -> dict[str, str | None]:
    """Where this host's GPU pods go: its node, and the RuntimeClass they name (where nvidia is not the
    default runtime), if any."""
    return {"node": _node_name(target), "runtime_class": str(target.want("runtime_class") or "") or None}


def _resource(target: Target, cluster: Cluster) -> str:
    return str(target.want("resource") or cluster.resource)


def _exactly_one_gpu(target: Target, run: PodRun, resource: str) -> None:
    assert len(run.gpus) == 1, (
        f"{target.name}: a pod with {resource}: 1 on node {run.node} sees {len(run.gpus)} GPUs "
        f"({', '.join(u for _, _, u in run.gpus) or 'none'}), expected exactly one"
    )
    assert len(run.devices) == 1, (
        f"{target.name}: a pod with {resource}: 1 has device nodes {run.devices or 'none'}, "
        "expected one /dev/nvidia<N>"
    )


def test_one_gpu_pod_sees_exactly_one_gpu(target: Target, cluster: Cluster) -> None:
    if target.want("sharing") == "memory":
        pytest.skip("GPU-memory sharing node: whole GPUs are not advertised here")
    resource = _resource(target, cluster)
    run = cluster.run_gpu_pod("one", {resource: "1"}, **_on(target))
    _ran(target.name, run, f"a {resource}: 1")
    _exactly_one_gpu(target, run, resource)


def test_two_gpu_pod_gets_an_nvlink_pair(target: Target, cluster: Cluster) -> None:
    if not target.want("nvlink"):
        pytest.skip("no NVLink expected on this host")
    if target.want("sharing") in ("memory", "time-slicing"):
        pytest.skip(f"{target.want('sharing')} node: two devices need not be two GPUs")
    run = cluster.run_gpu_pod("pair", {cluster.resource: "2"}, topology=True, **_on(target))
    _ran(target.name, run, f"a {cluster.resource}: 2")
    assert len(run.gpus) == 2, f"{target.name}: a pod with 2 GPUs sees {len(run.gpus)}"
    (a, _, uuid_a), (b, _, uuid_b) = run.gpus
    link = run.topology.get(f"GPU{a}", {}).get(f"GPU{b}", "")
    assert link.startswith("NV"), (
        f"{target.name}: the 2-GPU pod got GPU {a} ({uuid_a}) and GPU {b} ({uuid_b}), joined by "
        f"{link or 'an unknown path'}, not NVLink"
    )


def test_time_sliced_gpu_is_shared_by_pods_running_at_once(target: Target, cluster: Cluster) -> None:
    if target.want("sharing") != "time-slicing":
        pytest.skip("not a time-sliced node")
    gpus, replicas = int(target.want("gpu_count") or 0), int(target.want("replicas") or 1)
    assert gpus > 0 and replicas > 1, (
        f"{target.name}: a time-sliced host needs gpu_count and replicas > 1 in its expectations "
        f"(got gpu_count={target.want('gpu_count')}, replicas={target.want('replicas')})"
    )
    resource = _resource(target, cluster)
    runs = cluster.run_gpu_pods_at_once("slice", gpus + 1, {resource: "1"}, **_on(target))
    for run in runs:
        _ran(target.name, run, f"a time-sliced {resource}: 1")
        _exactly_one_gpu(target, run, resource)
    holders = Counter(run.gpus[0][2] for run in runs)
    shared = [uuid for uuid, pods in holders.items() if pods > 1]
    assert shared, (
        f"{target.name}: {len(runs)} pods ran at once on {gpus} GPUs and no GPU was seen by two of them: "
        f"{dict(holders)}"
    )


def test_gpu_memory_pod_lands_where_the_extender_put_it(target: Target, cluster: Cluster) -> None:
    if target.want("sharing") != "memory":
        pytest.skip("not a GPU-memory sharing node")
    gib = str(cluster.workload.get("gpu_mem_gib", 1))
    run = cluster.run_gpu_pod("mem", {cluster.memory_resource: gib}, **_on(target))
    _ran(target.name, run, f"a {cluster.memory_resource}: {gib}")
    text = (run.pod["metadata"].get("annotations") or {}).get("gpufleet.io/assignment")
    assert text, f"pod {run.name} on {run.node} has no gpufleet.io/assignment: the extender did not bind it"
    assignment = json.loads(text)
    assert assignment["node"] == run.node, (
        f"pod {run.name}: the extender assigned node {assignment['node']}, the pod runs on {run.node}"
    )
    assigned = sorted(g for c in assignment["containers"] for g in c["gpus"])
    seen = sorted(u for _, _, u in run.gpus)
    assert seen == assigned, (
        f"pod {run.name} on {run.node} sees GPUs {seen}, the extender assigned {assigned}"
    )


def _profile_mib(profile: str) -> int:
    """The memory a MIG profile's name promises, in MiB: "1g.10gb" (or "1c.3g.40gb") -> 10240 (40960)."""
    match = re.search(r"(\d+)g\.(\d+)gb", profile)
    assert match, f"MIG profile {profile!r} names no memory (<n>g.<m>gb)"
    return int(match.group(2)) * 1024


def test_mig_pod_sees_exactly_one_mig_device(target: Target, cluster: Cluster) -> None:
    if target.want("mig_strategy") != "mixed":
        pytest.skip("no MIG resources expected on this host (device plugin mig.strategy is not mixed)")
    node = cluster.node(_node_name(target)) or {}
    domain = cluster.resource.split("/", 1)[0]
    allocatable = node.get("status", {}).get("allocatable") or {}
    resources = sorted(r for r, n in allocatable.items() if r.startswith(f"{domain}/mig-") and int(n) > 0)
    assert resources, (
        f"{target.name}: its device plugin has mig.strategy mixed, but node {_node_name(target)} advertises "
        f"no {domain}/mig-<profile> (allocatable: {allocatable or 'none'})"
    )
    for resource in resources:
        profile = resource.rsplit("/", 1)[-1].removeprefix("mig-")
        run = cluster.run_gpu_pod("mig", {resource: "1"}, summary=True, **_on(target))
        _ran(target.name, run, f"a {resource}: 1")
        # nvidia-smi -L says `1g.18gb+me` where the resource says `mig-1g.18gb.me` (no `+` in resource names).
        assert [p.replace("+", ".") for p, _ in run.mig_devices] == [profile], (
            f"{target.name}: a pod with {resource}: 1 sees MIG devices {run.mig_devices or 'none'}, "
            f"expected exactly one {profile}"
        )
        assert len(run.gpus) == 1 and len(run.devices) == 1, (
            f"{target.name}: the {profile} pod sees GPUs {run.gpus} and device nodes {run.devices}, "
            "expected its MIG device's parent only"
        )
        assert len(run.mig_memory) == 1, (
            f"{target.name}: the {profile} pod's nvidia-smi lists {len(run.mig_memory)} MIG devices' memory"
        )
        total, nominal = run.mig_memory[0][1], _profile_mib(profile)
        assert 0.85 * nominal <= total <= nominal, (
            f"{target.name}: the {profile} pod's MIG device has {total} MiB, "
            f"not the ~{nominal} MiB of {profile}"
        )
