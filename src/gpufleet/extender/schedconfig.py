"""Generate the kube-scheduler's KubeSchedulerConfiguration that points at this extender.

Two API versions: `kubescheduler.config.k8s.io/v1` (Kubernetes 1.25 and later) and `v1beta1` (1.19-1.21,
the 1.20 test cluster). Their `extenders` entries share field names (urlPrefix, filterVerb,
prioritizeVerb, bindVerb, weight, enableHTTPS, tlsConfig, httpTimeout as a duration string,
nodeCacheCapable, managedResources, ignorable); v1beta1 still serves plain-HTTP healthz/metrics on
0.0.0.0:10251 unless told otherwise, so its bind addresses can be set here (v1 has no such fields).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..handoff import GPU_MEM_RESOURCE, WHOLE_GPU_RESOURCE

API_VERSIONS = {
    "v1": "kubescheduler.config.k8s.io/v1",
    "v1beta1": "kubescheduler.config.k8s.io/v1beta1",
}
_DURATION = re.compile(r"(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+")


class SchedulerConfigError(ValueError):
    """The requested scheduler configuration would not be accepted (or would not work)."""


@dataclass(frozen=True)
class SchedulerConfigOptions:
    """What goes into the generated configuration."""

    url: str
    api_version: str = "v1"
    weight: int = 5
    node_cache_capable: bool = True
    ignorable: bool = False
    http_timeout: str = "10s"
    bind: bool = True
    # The extender owns gpu-mem (per-GPU fit); the scheduler still checks whole-GPU counts itself.
    mem_ignored_by_scheduler: bool = True
    manage_whole_gpus: bool = True
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""
    insecure: bool = False
    kubeconfig: str = ""
    leader_elect: bool | None = None
    scheduler_name: str = ""
    healthz_bind_address: str = ""
    metrics_bind_address: str = ""


def scheduler_config(opts: SchedulerConfigOptions) -> dict[str, Any]:
    """The configuration as a dict; raise SchedulerConfigError on inconsistent options."""
    if opts.api_version not in API_VERSIONS:
        raise SchedulerConfigError(
            f"api version {opts.api_version!r}: choose one of {', '.join(API_VERSIONS)}"
        )
    parts = urlsplit(opts.url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SchedulerConfigError(f"extender URL {opts.url!r} must be http(s)://host:port/prefix")
    https = parts.scheme == "https"
    if not https and (opts.ca_file or opts.cert_file or opts.key_file or opts.server_name or opts.insecure):
        raise SchedulerConfigError("TLS options need an https:// extender URL")
    if bool(opts.cert_file) != bool(opts.key_file):
        raise SchedulerConfigError("client cert and key files go together")
    if opts.weight < 1:
        raise SchedulerConfigError("weight must be a positive integer")
    if not _DURATION.fullmatch(opts.http_timeout):
        raise SchedulerConfigError(f"http timeout {opts.http_timeout!r} is not a Go duration such as 10s")
    if opts.api_version == "v1" and (opts.healthz_bind_address or opts.metrics_bind_address):
        raise SchedulerConfigError("healthz/metrics bind addresses exist only in v1beta1")

    extender: dict[str, Any] = {
        "urlPrefix": opts.url.rstrip("/"),
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize",
        "weight": opts.weight,
    }
    if opts.bind:
        extender["bindVerb"] = "bind"
    extender["enableHTTPS"] = https
    if https:
        tls: dict[str, Any] = {}
        if opts.insecure:
            tls["insecure"] = True
        if opts.server_name:
            tls["serverName"] = opts.server_name
        if opts.ca_file:
            tls["caFile"] = opts.ca_file
        if opts.cert_file:
            tls["certFile"] = opts.cert_file
            tls["keyFile"] = opts.key_file
        if tls:
            extender["tlsConfig"] = tls
    extender["httpTimeout"] = opts.http_timeout
    extender["nodeCacheCapable"] = opts.node_cache_capable
    managed = [{"name": GPU_MEM_RESOURCE, "ignoredByScheduler": opts.mem_ignored_by_scheduler}]
    if opts.manage_whole_gpus:
        managed.append({"name": WHOLE_GPU_RESOURCE, "ignoredByScheduler": False})
    extender["managedResources"] = managed
    extender["ignorable"] = opts.ignorable

    doc: dict[str, Any] = {"apiVersion": API_VERSIONS[opts.api_version], "kind": "KubeSchedulerConfiguration"}
    if opts.kubeconfig:
        doc["clientConnection"] = {"kubeconfig": opts.kubeconfig}
    if opts.leader_elect is not None:
        doc["leaderElection"] = {"leaderElect": opts.leader_elect}
    if opts.healthz_bind_address:
        doc["healthzBindAddress"] = opts.healthz_bind_address
    if opts.metrics_bind_address:
        doc["metricsBindAddress"] = opts.metrics_bind_address
    if opts.scheduler_name:
        doc["profiles"] = [{"schedulerName": opts.scheduler_name}]
    doc["extenders"] = [extender]
    return doc


def render(opts: SchedulerConfigOptions) -> str:
    """The configuration as YAML, fields in the order the Go types declare them."""
    import yaml  # here, not at the top: the module that imports this file runs where PyYAML may be absent

    return yaml.safe_dump(scheduler_config(opts), sort_keys=False, default_flow_style=False)
