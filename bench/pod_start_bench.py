"""Pod start latency in the lab: create → Running for a GPU pod and a plain pod on each lab host, so the
kubelets on containerd 1.6, 1.7 and 2.1 can be set side by side.

    make lab        # or: gpufleet lab up && ansible-playbook -i inventory/lab site.yml
    python bench/pod_start_bench.py [--pods 10] [--hosts dgx-a100,esxi-vm-2x-v100]

Works on the lab `GPUFLEET_LAB_NAME` / `GPUFLEET_LAB_STATE` name (default: the one `make lab` made), after
site.yml converged it. Each pod is bound to its host by `nodeName` (the scheduler and the extender are not
what is measured), uses the lab's gpufleet image (present on every host, `imagePullPolicy: Never`) and runs
`sleep`; the GPU kind asks for one `nvidia.com/gpu` and names the host's RuntimeClass where the host keeps
runc as its default (pcie-2x-t4, esxi-vm-2x-v100). Hosts sharing GPU memory advertise no `nvidia.com/gpu`:
they get plain pods only. Pods run one at a time: created, timed from the create call to the watch event
that says Running, deleted, and gone before the next starts. The first pod of each row is shown on its own
(a cold start of the sandbox path); the others give the median, p90 and max.

Figures, not assertions. Everything GPU-facing here is the GPU simulator behind the stand-in NVIDIA runtime.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import statistics
import sys
import time
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from gpufleet_harness.cluster.process import wait_for
from gpufleet_harness.lab import lab as fleetlab
from gpufleet_harness.lab.spec import HostSpec, LabSpec

NAMESPACE = "gpufleet-bench"
GPU = "nvidia.com/gpu"
TIMEOUT_S = 180


def _pod(name: str, node: str, image: str, gpu: bool, runtime_class: str | None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main", "image": image, "imagePullPolicy": "Never", "command": ["sleep", "3600"],
    }  # fmt: skip
    spec: dict[str, Any] = {"nodeName": node, "restartPolicy": "Never", "terminationGracePeriodSeconds": 0}
    if gpu:
        container["resources"] = {"limits": {GPU: "1"}}
        if runtime_class:
            spec["runtimeClassName"] = runtime_class
    spec["containers"] = [container]
    meta = {"name": name, "namespace": NAMESPACE}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _start_seconds(core: Any, body: dict[str, Any]) -> float:
    """Create the pod and return the seconds until the API server says Running; delete it and wait it out."""
    name = body["metadata"]["name"]
    stream = watch.Watch()
    started = time.monotonic()
    created = core.create_namespaced_pod(NAMESPACE, body)
    try:
        for event in stream.stream(
            core.list_namespaced_pod, NAMESPACE, field_selector=f"metadata.name={name}",
            resource_version=created.metadata.resource_version, timeout_seconds=TIMEOUT_S,
        ):  # fmt: skip
            phase = event["object"].status.phase
            if phase == "Running":
                return time.monotonic() - started
            if phase in ("Failed", "Succeeded"):
                raise SystemExit(f"pod {name} ended {phase} before it ran: {event['object'].status}")
        raise SystemExit(f"pod {name} not Running after {TIMEOUT_S} s")
    finally:
        stream.stop()
        _delete(core, name)


def _delete(core: Any, name: str) -> None:
    with contextlib.suppress(ApiException):
        core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)

    def gone() -> bool:
        try:
            core.read_namespaced_pod(name, NAMESPACE)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    wait_for(f"pod {name} to be gone after its deletion", gone, TIMEOUT_S, interval=0.2)


def _namespace(core: Any) -> None:
    """The bench's namespace, once its default service account has its token (Kubernetes 1.20 admits no pod
    before that)."""
    with contextlib.suppress(ApiException):
        core.create_namespace({"metadata": {"name": NAMESPACE}})

    def token() -> bool:
        with contextlib.suppress(ApiException):
            return bool(core.read_namespaced_service_account("default", NAMESPACE).secrets)
        return False

    wait_for(f"a token for service account default in {NAMESPACE}", token, TIMEOUT_S, interval=0.5)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}"


def _row(core: Any, host: HostSpec, gpu: bool, image: str, pods: int) -> tuple[Any, ...]:
    """One table row: `pods` pods of one kind on `host`, one at a time."""
    tag = secrets.token_hex(3)
    runtime_class = "nvidia" if host.runtime_class else None
    times = []
    for i in range(pods):
        name = f"start-{host.name}-{'gpu' if gpu else 'plain'}-{tag}-{i}"
        times.append(_start_seconds(core, _pod(name, host.name, image, gpu, runtime_class)))
    rest = sorted(times[1:]) or times
    p90 = rest[min(len(rest) - 1, round(0.9 * (len(rest) - 1)))]
    kind = ("GPU (RuntimeClass nvidia)" if runtime_class else "GPU") if gpu else "plain"
    print(f"  {host.name} {kind}: {', '.join(_ms(t) for t in times)} ms", file=sys.stderr)
    runtime = f"{host.runtime} {host.containerd}"
    return (host.name, runtime, kind, len(times), times[0], statistics.median(rest), p90, max(rest))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=10, help="pods per host and kind (default 10)")
    parser.add_argument("--hosts", default="", help="comma-separated lab hosts (default: all)")
    args = parser.parse_args(argv)
    spec = LabSpec.from_env()
    state = fleetlab.read_state(spec)
    if state is None:
        raise SystemExit(f"no lab {spec.name!r} is up (state {spec.state_dir}): run `make lab` first")
    wanted = [h for h in args.hosts.split(",") if h]
    hosts = [h for h in spec.hosts if not wanted or h.name in wanted]
    nodes = fleetlab.node_conditions(state["kubeconfig"])
    core = client.CoreV1Api(config.new_client_from_config(config_file=state["kubeconfig"]))
    _namespace(core)
    rows = []
    try:
        for host in hosts:
            kinds = [False, True] if nodes.get(host.name, {}).get("gpus") else [False]
            for gpu in kinds:
                rows.append(_row(core, host, gpu, state["gpufleet_image"], args.pods))
    finally:
        core.api_client.close()
    head = ("host", "runtime", "pod", "n", "first ms", "median ms", "p90 ms", "max ms")
    table = [head, *[(h, r, k, str(n), _ms(f), _ms(m), _ms(p), _ms(x)) for h, r, k, n, f, m, p, x in rows]]
    widths = [max(len(row[c]) for row in table) for c in range(len(head))]
    for row in table:
        cells = (cell.ljust(widths[c]) if c < 3 else cell.rjust(widths[c]) for c, cell in enumerate(row))
        print("  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
