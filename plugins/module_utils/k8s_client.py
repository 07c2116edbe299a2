# Copyright: gpufleet contributors
# Apache License 2.0 (see the repository's pyproject.toml)
"""Kubernetes connection for gpufleet's modules: options, client, raw REST calls, readable errors.

Every call goes through :class:`Kube`, which speaks JSON to the API server's REST paths (no client
models: they fail on some replies of older servers) and turns every failure into a :class:`KubeError`
whose message names what was attempted and never carries a credential:

- no kubeconfig found, or a broken one → ``no kubeconfig: ...`` / ``kubeconfig ...: ...``;
- API server unreachable → ``cannot reach the API server at https://...: <reason>``;
- 401 → ``unauthorized: ...``; 403 → ``forbidden: <verb> <resource> in <namespace>`` (or ``at cluster
  scope``) followed by the API server's own reason;
- anything else → ``<verb> <resource> <namespace>/<name>: HTTP <code> <reason>: <API message>``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

try:
    import urllib3
    from kubernetes import client as k8s_client
    from kubernetes import config as k8s_config
    from kubernetes.client.rest import ApiException
    from kubernetes.config.config_exception import ConfigException

    HAS_KUBERNETES = True
    KUBERNETES_IMPORT_ERROR: str | None = None
except ImportError as _err:  # reported by the modules through missing_required_lib
    HAS_KUBERNETES = False
    KUBERNETES_IMPORT_ERROR = str(_err)

DEFAULT_KUBECONFIG = "~/.kube/config"

# Options shared by every gpufleet module that talks to Kubernetes (merged into argument_spec), documented
# by the doc fragment gpufleet.nvidia.k8s (plugins/doc_fragments/k8s.py).
CONNECTION_ARGS: dict[str, dict[str, Any]] = {
    "kubeconfig": {"type": "path"},
    "context": {"type": "str"},
    "host": {"type": "str"},
    "api_key": {"type": "str", "no_log": True},
    "ca_cert": {"type": "path"},
    "validate_certs": {"type": "bool", "default": True},
    "request_timeout": {"type": "int", "default": 30},
}


class KubeError(Exception):
    """A Kubernetes operation failed; the message is safe to show (no tokens, no certificates)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.partial: Any = None  # an ApplyResult of the objects handled before the failure


class NotFound(KubeError):
    """The object does not exist (HTTP 404)."""


@dataclass(frozen=True)
class Resource:
    """Where objects of one kind live in the REST API."""

    kind: str
    api_version: str
    plural: str
    namespaced: bool

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def display(self) -> str:
        """``daemonsets.apps``, ``clusterroles.rbac.authorization.k8s.io``, ``pods``: as RBAC names them."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str = "") -> str:
        """The REST path of the collection, or of one object (and a subresource of it)."""
        prefix = f"/apis/{self.api_version}" if self.group else f"/api/{self.api_version}"
        if self.namespaced:
            if not namespace:
                raise KubeError(f"{self.kind} {name or ''}: a namespace is required")
            prefix += f"/namespaces/{quote(namespace, safe='')}"
        path = f"{prefix}/{self.plural}"
        if name:
            path += f"/{quote(name, safe='')}"
            if subresource:
                path += f"/{subresource}"
        return path


RESOURCES: dict[str, Resource] = {
    r.kind: r
    for r in (
        Resource("Namespace", "v1", "namespaces", False),
        Resource("Node", "v1", "nodes", False),
        Resource("Pod", "v1", "pods", True),
        Resource("Service", "v1", "services", True),
        Resource("ServiceAccount", "v1", "serviceaccounts", True),
        Resource("ConfigMap", "v1", "configmaps", True),
        Resource("Secret", "v1", "secrets", True),
        Resource("Event", "v1", "events", True),
        Resource("DaemonSet", "apps/v1", "daemonsets", True),
        Resource("Deployment", "apps/v1", "deployments", True),
        Resource("ReplicaSet", "apps/v1", "replicasets", True),
        Resource("ClusterRole", "rbac.authorization.k8s.io/v1", "clusterroles", False),
        Resource("ClusterRoleBinding", "rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
        Resource("Role", "rbac.authorization.k8s.io/v1", "roles", True),
        Resource("RoleBinding", "rbac.authorization.k8s.io/v1", "rolebindings", True),
        Resource("RuntimeClass", "node.k8s.io/v1", "runtimeclasses", False),
    )
}


def resource_for(obj: Mapping[str, Any]) -> Resource:
    """The :class:`Resource` of a manifest (by ``kind``), checking its ``apiVersion``."""
    kind = obj.get("kind", "")
    res = RESOURCES.get(kind)
    if res is None:
        raise KubeError(f"kind {kind!r} is not one gpufleet manages ({', '.join(sorted(RESOURCES))})")
    if obj.get("apiVersion", res.api_version) != res.api_version:
        raise KubeError(f"{kind}: apiVersion {obj.get('apiVersion')!r}, expected {res.api_version!r}")
    return res


@dataclass(frozen=True)
class ConnectionOptions:
    """How to reach the API server; ``repr`` never shows the token."""

    kubeconfig: str | None = None
    context: str | None = None
    host: str | None = None
    api_key: str | None = None
    ca_cert: str | None = None
    validate_certs: bool = True
    request_timeout: int = 30

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> ConnectionOptions:
        """From a module's parameters (the keys of :data:`CONNECTION_ARGS`)."""
        given: dict[str, Any] = {
            key: params.get(key) for key in CONNECTION_ARGS if params.get(key) is not None
        }
        return cls(**given)

    def __repr__(self) -> str:
        return (
            f"ConnectionOptions(kubeconfig={self.kubeconfig!r}, context={self.context!r}, "
            f"host={self.host!r}, api_key={'<set>' if self.api_key else None})"
        )


def _kubeconfig_path(opts: ConnectionOptions) -> str:
    """The kubeconfig file to read: the option, else $KUBECONFIG (first entry), else ~/.kube/config."""
    if opts.kubeconfig:
        path = os.path.expanduser(opts.kubeconfig)
        if not os.path.isfile(path):
            raise KubeError(f"no kubeconfig: {path} does not exist")
        return path
    env = os.environ.get("KUBECONFIG", "")
    candidates = [p for p in env.split(os.pathsep) if p] or [DEFAULT_KUBECONFIG]
    for candidate in candidates:
        path = os.path.expanduser(candidate)
        if os.path.isfile(path):
            return path
    where = f"$KUBECONFIG ({env})" if env else DEFAULT_KUBECONFIG
    raise KubeError(f"no kubeconfig: {where} does not exist; set the kubeconfig option, or host and api_key")


def build_configuration(opts: ConnectionOptions) -> Any:
    """A ``kubernetes.client.Configuration`` from the options (host + token wins over a kubeconfig)."""
    configuration = k8s_client.Configuration()
    if opts.host and opts.api_key:
        configuration.host = opts.host.rstrip("/")
        configuration.api_key = {"authorization": opts.api_key}
        configuration.api_key_prefix = {"authorization": "Bearer"}
        if opts.ca_cert:
            configuration.ssl_ca_cert = os.path.expanduser(opts.ca_cert)
    elif opts.host or opts.api_key:
        raise KubeError("host and api_key go together (or use a kubeconfig)")
    else:
        path = _kubeconfig_path(opts)
        try:
            k8s_config.load_kube_config(
                config_file=path,
                context=opts.context,
                client_configuration=configuration,
                persist_config=False,
            )
        except ConfigException as exc:
            raise KubeError(f"kubeconfig {path}: {exc}") from None
        except (OSError, ValueError) as exc:
            raise KubeError(f"kubeconfig {path} cannot be read: {type(exc).__name__}: {exc}") from None
        if opts.ca_cert:
            configuration.ssl_ca_cert = os.path.expanduser(opts.ca_cert)
    configuration.verify_ssl = opts.validate_certs
    # One retry: an unreachable server should fail within the request timeout, not after urllib3's backoff.
    configuration.retries = 1
    return configuration


def _api_message(body: Any) -> str:
    """The ``message`` of a Status reply, else a short prefix of the body."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    try:
        doc = json.loads(body) if body else {}
    except ValueError:
        return str(body)[:200]
    if isinstance(doc, dict):
        return str(doc.get("message") or doc.get("reason") or "")
    return str(doc)[:200]


def _unreachable_reason(exc: BaseException) -> str:
    """Why a connection failed, without URL queries or headers (the innermost cause, shortened)."""
    reason: BaseException = exc
    while isinstance(getattr(reason, "reason", None), BaseException):
        reason = reason.reason  # type: ignore[attr-defined]
    text = str(reason)
    # urllib3 puts "<urllib3.connection.HTTPSConnection object at 0x...>: " before the errno text
    if ">: " in text:
        text = text.split(">: ", 1)[1]
    return text or type(reason).__name__


class Kube:
    """A connected client: raw JSON calls with translated errors, plus the few reads the modules share."""

    def __init__(self, opts: ConnectionOptions) -> None:
        if not HAS_KUBERNETES:
            raise KubeError(f"the kubernetes Python library is missing: {KUBERNETES_IMPORT_ERROR}")
        self.opts = opts
        self.configuration = build_configuration(opts)
        self.host = self.configuration.host
        self.api = k8s_client.ApiClient(self.configuration)
        if not opts.validate_certs:
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)

    def close(self) -> None:
        """Release the connection pool."""
        self.api.close()

    # -- raw calls ---------------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        what: tuple[str, str, str | None, str | None] = ("", "", None, None),
        raw: bool = False,
    ) -> Any:
        """One REST call; ``what`` = (verb, resource, namespace, name) names it in errors.

        Returns the decoded JSON reply, or the text with ``raw``.
        """
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        query_params = [(k, v) for k, v in (query or {}).items() if v is not None]
        try:
            method, url, headers, body, _post = self.api.param_serialize(
                method,
                path,
                query_params=query_params,
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self.api.call_api(
                method, url, headers, body, _request_timeout=self.opts.request_timeout
            )
            data = response.read()
        except ApiException as exc:  # TLS failures arrive as status 0
            if not exc.status:
                raise KubeError(f"cannot reach the API server at {self.host}: {exc.reason}") from None
            raise self._translate_status(exc.status, exc.reason, exc.body, what) from None
        except urllib3.exceptions.HTTPError as exc:
            raise KubeError(
                f"cannot reach the API server at {self.host}: {_unreachable_reason(exc)}"
            ) from None
        except OSError as exc:
            raise KubeError(f"cannot reach the API server at {self.host}: {exc}") from None
        if not 200 <= response.status <= 299:
            raise self._translate_status(response.status, response.reason, data, what)
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data or "")
        if raw:
            return text
        try:
            return json.loads(text) if text else {}
        except ValueError:
            raise KubeError(
                f"{' '.join(filter(None, what[:2]))}: the API server's reply is not JSON"
            ) from None

    def _translate_status(
        self, status: int, reason: str | None, body: Any, what: tuple[str, str, str | None, str | None]
    ) -> KubeError:
        verb, resource, namespace, name = what
        message = _api_message(body)
        where = f"in {namespace}" if namespace else "at cluster scope"
        if status == 403:
            return KubeError(f"forbidden: {verb} {resource} {where}: {message}", status)
        if status == 401:
            return KubeError(
                f"unauthorized: the API server at {self.host} rejected the credentials "
                f"(expired or wrong token or certificate) while trying to {verb} {resource}",
                status,
            )
        target = f"{namespace}/{name}" if namespace and name else (name or namespace or "")
        text = f"{verb} {resource} {target}".strip() + f": HTTP {status} {reason or ''}".rstrip()
        if message:
            text += f": {message}"
        if status == 404:
            return NotFound(text, status)
        return KubeError(text, status)

    # -- object helpers ----------------------------------------------------------------------------
    def get(self, res: Resource, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """The object, or None if it does not exist."""
        try:
            return self.request("GET", res.path(namespace, name), what=("get", res.display, namespace, name))  # type: ignore[no-any-return]
        except NotFound:
            return None

    def list(
        self,
        res: Resource,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        """Objects of a kind (all namespaces when ``namespace`` is None for namespaced kinds)."""
        if res.namespaced and not namespace:
            prefix = f"/apis/{res.api_version}" if res.group else f"/api/{res.api_version}"
            path = f"{prefix}/{res.plural}"
        else:
            path = res.path(namespace)
        query = {"labelSelector": label_selector, "fieldSelector": field_selector}
        doc = self.request("GET", path, query=query, what=("list", res.display, namespace, None))
        return list(doc.get("items") or [])

    def pod_log(self, name: str, namespace: str, container: str | None = None, lines: int = 20) -> str:
        """The last ``lines`` of a pod's log ('' when there is none yet)."""
        pods = RESOURCES["Pod"]
        query = {"tailLines": lines, "container": container}
        try:
            return self.request(  # type: ignore[no-any-return]
                "GET",
                pods.path(namespace, name, "log"),
                query=query,
                raw=True,
                what=("get", "pods/log", namespace, name),
            )
        except KubeError:
            return ""

    def server_version(self) -> str:
        """``gitVersion`` of the API server (also proves it is reachable with these credentials)."""
        return str(self.request("GET", "/version", what=("get", "version", None, None)).get("gitVersion", ""))
