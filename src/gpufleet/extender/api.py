"""The scheduler extender protocol (k8s.io/kube-scheduler/extender/v1) on top of the decisions.

The Go types carry no JSON tags, so the wire names are the Go field names: ExtenderArgs{Pod, Nodes,
NodeNames}, ExtenderFilterResult{Nodes, NodeNames, FailedNodes, FailedAndUnresolvableNodes, Error},
HostPriorityList [{Host, Score}], ExtenderBindingArgs{PodName, PodNamespace, PodUID, Node},
ExtenderBindingResult{Error}. Pod and Node inside are ordinary Kubernetes JSON.

Structural problems (not JSON, missing fields, wrong types) raise `BadRequest` (HTTP 400); a pod whose
GPU request makes no sense gets a 200 result whose Error says why, as the scheduler expects.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpufleet.extender.binder import Binder, BindError
from gpufleet.extender.bindlocks import ReservationsFull
from gpufleet.extender.metrics import Metrics
from gpufleet.extender.request import GpuRequest, Policy, RequestError, parse_pod
from gpufleet.extender.scheduling import (
    MAX_PRIORITY,
    Candidates,
    ScoreTable,
    choose,
    filter_nodes,
    score_table,
)
from gpufleet.extender.state import ClusterState


class BadRequest(ValueError):
    """The request body is not a well-formed extender message."""


MAX_CANDIDATE_NODES = 100_000
"""Most candidate nodes one call may carry: 20x Kubernetes' largest supported cluster (5,000 nodes); the
body-size limit bounds it too, this says so in the error instead of in a slow reply."""


def _pod(args: Any) -> Mapping[str, Any]:
    if not isinstance(args, dict):
        raise BadRequest("body must be a JSON object (ExtenderArgs)")
    pod = args.get("Pod")
    if not isinstance(pod, dict):
        raise BadRequest("ExtenderArgs.Pod is missing or not an object")
    meta = pod.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
        raise BadRequest("ExtenderArgs.Pod.metadata.name is missing")
    return pod


_is_str = str.__instancecheck__


def _named(node: Any) -> bool:
    """Whether a NodeList item is an object with a string metadata.name."""
    meta = node.get("metadata") if isinstance(node, dict) else None
    return isinstance(meta, dict) and isinstance(meta.get("name"), str)


def _bounded(candidates: list[Any]) -> None:
    if len(candidates) > MAX_CANDIDATE_NODES:
        raise BadRequest(f"{len(candidates)} candidate nodes; at most {MAX_CANDIDATE_NODES} per call")


# Pre-encoded HostPriority tails per score ("7}"), see ExtenderApi.prioritize_json.
_SCORE_TAILS = tuple(f"{score}}}" for score in range(MAX_PRIORITY + 1))


class _Fragments(dict[str, str]):
    """A string -> its JSON fragment, made on first use: `prefix + json.dumps(text) + suffix`."""

    def __init__(self, prefix: str, suffix: str) -> None:
        super().__init__()
        self.prefix, self.suffix = prefix, suffix

    def __missing__(self, text: str) -> str:
        fragment = self[text] = self.prefix + json.dumps(text) + self.suffix
        return fragment

    def trim(self, limit: int) -> None:
        """Forget everything once over `limit` entries (node names and reasons come and go)."""
        if len(self) > limit:
            self.clear()


def _candidates(args: Mapping[str, Any]) -> tuple[Candidates, bool]:
    """The candidate nodes and whether they came as names (nodeCacheCapable) or Node objects."""
    names = args.get("NodeNames")
    if names is not None:
        if not isinstance(names, list) or not all(map(_is_str, names)):
            raise BadRequest("ExtenderArgs.NodeNames must be a list of strings")
        _bounded(names)
        return names, True
    nodes = args.get("Nodes")
    if nodes is not None:
        items = nodes.get("items") if isinstance(nodes, dict) else None
        if items is None and isinstance(nodes, dict):
            items = []
        if not isinstance(items, list) or not all(map(_named, items)):
            raise BadRequest("ExtenderArgs.Nodes must be a NodeList whose items have metadata.name")
        _bounded(items)
        return items, False
    raise BadRequest("ExtenderArgs needs NodeNames (nodeCacheCapable) or Nodes")


class ExtenderApi:
    """filter / prioritize / bind as dict-in, dict-out calls (the HTTP server adds only transport)."""

    def __init__(
        self,
        state: ClusterState,
        binder: Binder,
        metrics: Metrics,
        node_policy: Policy = Policy.BINPACK,
        gpu_policy: Policy = Policy.BINPACK,
        clock: Callable[[], float] = time.time,
        filter_wait: float = 0.0,
    ) -> None:
        self.state = state
        self.filter_wait = filter_wait
        self.binder = binder
        self.metrics = metrics
        self.node_policy = node_policy
        self.gpu_policy = gpu_policy
        self.clock = clock
        # JSON fragments encoded once: a node's HostPriority up to the score ('{"Host":"n1","Score":'),
        # a node name as a map key ('"n1":') and a failure reason as a value.
        self._hosts = _Fragments('{"Host":', ',"Score":')
        self._keys = _Fragments("", ":")
        self._reasons = _Fragments("", "")

    def filter(self, args: Any) -> dict[str, Any]:
        """ExtenderArgs -> ExtenderFilterResult."""
        pod = _pod(args)
        candidates, by_name = _candidates(args)
        result: dict[str, Any] = {
            "Nodes": None,
            "NodeNames": None,
            "FailedNodes": {},
            "FailedAndUnresolvableNodes": {},
            "Error": "",
        }
        try:
            req = parse_pod(pod)
        except RequestError as exc:
            result["Error"] = str(exc)
            return result
        if not self.state.synced:
            result["Error"] = "gpufleet extender: cache not synced yet; retry"
            return result
        now = self.clock()
        outcome = filter_nodes(self.state, req, candidates, self.gpu_policy, now)
        fitting = len(outcome.fits)
        if req.kind == "mem" and outcome.fits:
            # The extender places GPU memory itself: it answers the one node it chose and holds that
            # placement for the pod until its bind (docs/extender.md, "Decisions").
            if by_name:
                chosen: Candidates = outcome.fits
            else:
                fit_names = set(outcome.fits)
                chosen = [
                    c for c in candidates if not isinstance(c, str) and c["metadata"]["name"] in fit_names
                ]
            try:
                name, waited = choose(
                    self.state, req, chosen, self.node_policy, self.gpu_policy, self.filter_wait
                )
            except ReservationsFull as exc:
                self.metrics.inc("gpufleet_extender_reservations_refused_total")
                outcome.fits = []
                outcome.error = f"gpufleet extender: {exc}"
            else:
                outcome.fits = [name] if name else []
                if waited:
                    self.metrics.inc("gpufleet_extender_filter_waits_total")
        if by_name:
            result["NodeNames"] = outcome.fits
        else:
            fit = set(outcome.fits)
            items: Sequence[Mapping[str, Any]] = [n for n in candidates if not isinstance(n, str)]
            result["Nodes"] = {
                "apiVersion": "v1",
                "kind": "NodeList",
                "metadata": {},
                "items": [n for n in items if n["metadata"]["name"] in fit],
            }
        # Unresolvable nodes go in both maps: newer schedulers let FailedAndUnresolvableNodes take
        # precedence, and 1.20 (which ignores that field) still gets the reason into the pod's event.
        result["FailedNodes"] = {**outcome.failed, **outcome.unresolvable}
        result["FailedAndUnresolvableNodes"] = outcome.unresolvable
        result["Error"] = outcome.error
        self.metrics.inc("gpufleet_extender_filter_nodes_total", fitting, outcome="fit")
        self.metrics.inc("gpufleet_extender_filter_nodes_total", len(outcome.failed), outcome="failed")
        self.metrics.inc(
            "gpufleet_extender_filter_nodes_total", len(outcome.unresolvable), outcome="unresolvable"
        )
        return result

    def filter_json(self, args: Any) -> bytes:
        """`filter`, JSON-encoded as the HTTP server sends it; the failure maps from fragments encoded once.

        At 5,000 nodes that do not fit, encoding the same few reasons 10,000 times cost more than the
        decision. The bytes are exactly `json.dumps(filter(args), separators=(",", ":"))`.
        """
        result = self.filter(args)
        self._keys.trim(2 * self.state.node_count() + 1000)
        self._reasons.trim(10_000)
        keys, reasons = self._keys, self._reasons
        parts = []
        for field, value in result.items():
            if field in ("FailedNodes", "FailedAndUnresolvableNodes"):
                encoded = "{" + ",".join([keys[n] + reasons[r] for n, r in value.items()]) + "}"
            else:
                encoded = json.dumps(value, separators=(",", ":"))
            parts.append(f'"{field}":{encoded}')
        return ("{" + ",".join(parts) + "}").encode()

    def prioritize(self, args: Any) -> list[dict[str, Any]]:
        """ExtenderArgs -> HostPriorityList (scores 0..MaxExtenderPriority)."""
        table = self._table(args)
        return [
            {"Host": name, "Score": score} for name, score in zip(table.names, table.scores(), strict=True)
        ]

    def prioritize_json(self, args: Any) -> bytes:
        """`prioritize`, JSON-encoded as the HTTP server sends it, from per-node fragments encoded once.

        At 5,000 nodes, building and encoding one dict per node cost more than the decision.
        """
        table = self._table(args)
        self._hosts.trim(2 * self.state.node_count() + 1000)
        return ("[" + ",".join(table.encode(self._hosts, _SCORE_TAILS)) + "]").encode()

    def _table(self, args: Any) -> ScoreTable:
        pod = _pod(args)
        candidates, _ = _candidates(args)
        try:
            req: GpuRequest | None = parse_pod(pod)
        except RequestError:
            req = None  # filter already told the scheduler; a priority list cannot carry an error
        if req is None or not self.state.synced:
            names = [c if isinstance(c, str) else c["metadata"]["name"] for c in candidates]
            return ScoreTable(names, {}, set(), 0.0, 0.0)
        return score_table(self.state, req, candidates, self.node_policy, self.gpu_policy, self.clock())

    def bind(self, args: Any) -> dict[str, Any]:
        """ExtenderBindingArgs -> ExtenderBindingResult."""
        if not isinstance(args, dict):
            raise BadRequest("body must be a JSON object (ExtenderBindingArgs)")
        for key in ("PodName", "Node"):
            if not isinstance(args.get(key), str) or not args[key]:
                raise BadRequest(f"ExtenderBindingArgs.{key} is missing")
        namespace = args.get("PodNamespace") or "default"
        uid = args.get("PodUID") or ""
        if not isinstance(namespace, str) or not isinstance(uid, str):
            raise BadRequest("ExtenderBindingArgs.PodNamespace and PodUID must be strings")
        try:
            self.binder.bind(namespace, args["PodName"], uid, args["Node"])
        except BindError as exc:
            return {"Error": f"gpufleet extender: {exc}"}
        return {"Error": ""}
