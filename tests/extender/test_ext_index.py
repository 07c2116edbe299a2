"""The index filter and prioritize read must stay exactly what a brute-force scan decides.

Randomized histories of node add/update/delete/re-create (bind-locks, GPU health, new cards, the GPUs
annotation missing, malformed or re-serialized, sharing, product and MPS labels, unrelated metadata),
pod add/bind/re-annotate/finish/delete (also before their node exists), reservations as the binder makes
them (reserve, re-plan, release, settle, a watch event racing each), partial relists, restarts, expiring
claims and moving clocks are replayed on a `ClusterState`; after every step every index record must
equal one rebuilt from scratch, and after every few steps, for a batch of random requests, `filter_nodes`
and `prioritize_nodes` must equal a reference that calls `placement.evaluate` on every candidate node and
scores as the extender always did. An index bug is a wrong placement, so any difference fails. Another
test replays such a history on one thread while others read under the state's lock.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from extender_builders import gpu, node, pod

from gpufleet.extender.index import NodeFacts, NodeShape, Record
from gpufleet.extender.index import record as index_record
from gpufleet.extender.model import NodeInfo, node_info
from gpufleet.extender.placement import Placement
from gpufleet.extender.request import GpuRequest, Policy, parse_pod
from gpufleet.extender.scheduling import UNKNOWN_NODE, filter_nodes, placement_figures, prioritize_nodes
from gpufleet.extender.state import ClusterState

START = 1_700_000_000.0

MODELS = [
    ("NVIDIA A100-SXM4-80GB", "8.0", 80),
    ("NVIDIA A100-PCIE-40GB", "8.0", 40),
    ("Tesla T4", "7.5", 16),
    ("NVIDIA H100 80GB HBM3", "9.0", 80),
    ("NVIDIA A10", "8.6", 24),
]
MODEL_WISHES = ["A100", "T4, H100", "A100 80GB", "A10", "H100", "V100", "a100-pcie"]
CC_WISHES = ["7.0", "7.5", "8.0", "8.6", "9.0", "9.5"]


# ---------------------------------------------------------------------- the reference (brute force)


def _reference_info(state: ClusterState, cand: str | Mapping[str, Any]) -> tuple[str, NodeInfo | None, str]:
    if isinstance(cand, str):
        entry = state.entry(cand)
        return cand, entry.info if entry else None, ""
    meta = cand.get("metadata") or {}
    name = str(meta.get("name") or "")
    entry = state.entry(name)
    if (
        entry is not None
        and entry.info is not None
        and entry.info.resource_version == str(meta.get("resourceVersion") or "")
    ):
        return name, entry.info, ""
    try:
        return name, node_info(cand), ""
    except ValueError as exc:
        return name, None, str(exc)


def reference_filter(
    state: ClusterState, req: GpuRequest, candidates: Sequence[Any], gpu_policy: Policy, now: float
) -> tuple[list[str], dict[str, str], dict[str, str], str]:
    """evaluate() on every candidate, and the cluster-wide "absurd request" check by scanning every GPU."""
    infos = [_reference_info(state, c) for c in candidates]
    if req.kind == "none":
        return [name for name, _, _ in infos], {}, {}, ""
    fits: list[str] = []
    failed: dict[str, str] = {}
    unresolvable: dict[str, str] = {}
    for name, info, error in infos:
        if info is None:
            failed[name] = error or UNKNOWN_NODE
            continue
        verdict = state.evaluate(req, info, req.gpu_policy or gpu_policy, now)
        if verdict.fits:
            fits.append(name)
        elif verdict.unresolvable:
            unresolvable[name] = verdict.reason
        else:
            failed[name] = verdict.reason
    error = ""
    if not fits:
        known = [e.info for e in state.entries().values() if e.info is not None]
        every = [*known, *(i for _, i, _ in infos if i is not None)]
        if req.kind == "mem":
            largest = max((g.memory_gib for i in every for g in i.gpus if g.healthy), default=0)
            if req.max_share > largest:
                error = (
                    f"pod {req.key} asks {req.max_share} GiB on one GPU; the largest healthy GPU in the "
                    f"cluster has {largest} GiB"
                )
        else:
            most = max((sum(1 for g in i.gpus if g.healthy) for i in every), default=0)
            if req.whole > most:
                error = (
                    f"pod {req.key} asks {req.whole} whole GPUs; no node has more than {most} healthy GPUs"
                )
    return fits, failed, unresolvable, error


def reference_prioritize(
    state: ClusterState,
    req: GpuRequest,
    candidates: Sequence[Any],
    node_policy: Policy,
    gpu_policy: Policy,
    now: float,
) -> list[tuple[str, int]]:
    """The scoring by brute force: evaluate() per node, then the relative 0-10 scale."""
    infos = [_reference_info(state, c) for c in candidates]
    if req.kind == "none":
        return [(name, 0) for name, _, _ in infos]
    npolicy = req.node_policy or node_policy
    gpolicy = req.gpu_policy or gpu_policy
    placements: dict[str, Placement] = {}
    handing_off: set[str] = set()
    for name, info, _ in infos:
        if info is None:
            continue
        verdict = state.evaluate(req, info, gpolicy, now)
        if verdict.placement is not None:
            placements[name] = verdict.placement
            entry = state.entry(name)
            if entry is not None and entry.lock_expires > now and entry.lock_uid != req.uid:
                handing_off.add(name)
    multi = req.whole > 1 or any(c.gpus > 1 for c in req.mem)
    levels = sorted({p.capability for p in placements.values()})
    position = {level: i / (len(levels) - 1) for i, level in enumerate(levels)} if len(levels) > 1 else {}
    composite: dict[str, float] = {}
    for name, placement in placements.items():
        fill = placement.utilization if npolicy is Policy.BINPACK else 1.0 - placement.utilization
        total, weight = 1.0 * fill, 1.0
        if multi:
            total += 2.0 * placement.topology
            weight += 2.0
        if req.most_capable:
            total += 3.0 * position.get(placement.capability, 1.0)
            weight += 3.0
        composite[name] = total / weight
    # A node in a hand-off is ranked last only while a free fitting node matches it on the pod's wish.
    wish = {
        name: (2.0 * p.topology if multi else 0.0)
        + (3.0 * position.get(p.capability, 1.0) if req.most_capable else 0.0)
        for name, p in placements.items()
    }
    free = [wish[n] for n in placements if n not in handing_off]
    if free:
        handing_off = {n for n in handing_off if wish[n] <= max(free) + 1e-9}
    if handing_off and len(handing_off) < len(composite):
        ranked = {n: c for n, c in composite.items() if n not in handing_off}
    else:
        ranked, handing_off = composite, set()
    low = min(ranked.values(), default=0.0)
    span = max(ranked.values(), default=0.0) - low
    scores = []
    for name, _, _ in infos:
        if name not in composite:
            scores.append((name, 0))
        elif name in handing_off:
            scores.append((name, 1))
        elif span < 1e-9:
            scores.append((name, 10))
        else:
            scores.append((name, 1 + round(9 * (composite[name] - low) / span)))
    return scores


def normalized_record(state: ClusterState, record: Record) -> dict[str, Any]:
    """A record in plain, comparable data (signature ids resolved to the kinds they stand for)."""
    facts = record.facts
    views = {mask: (v.free, v.total, v.pick, v.cap) for mask, v in facts.views.items()}
    # Everything but the facts (compared below) and the memo (outcomes of requests: a cache).
    skip = ("facts", "memo")
    plain = {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.name not in skip}
    return {
        **plain,
        "sig": state.signatures.kinds[record.sig],
        "sums": tuple(record.sums),
        "busy": facts.busy,
        "idle_cap": facts.idle_cap,
        "error": facts.shape.error,
        "views": views,
    }


def check_index(state: ClusterState) -> None:
    """Every known node's record equals one built from scratch from its info and ledger; no stray ones."""
    with state.lock:
        known = {name: e for name, e in state.entries().items() if e.info is not None}
        assert set(state.index) == set(known)
        # The ledger decides on exactly the Nodes the watch cache holds.
        assert {name: e.info for name, e in known.items()} == state.watch.nodes
        for name, entry in known.items():
            assert entry.info is not None
            shape = NodeShape(entry.info, state.signatures.id(entry.info.kinds))
            fresh = index_record(
                shape, NodeFacts(shape, dict(entry.used)), entry.lock_expires, entry.lock_uid, entry.whole
            )
            for mask in state.index[name].facts.views:  # lazily built views too
                fresh.facts.view_for(mask)
            assert normalized_record(state, state.index[name]) == normalized_record(state, fresh), name


# ---------------------------------------------------------------------- random worlds


class World:
    """Node and pod objects as the API would hold them, replayed onto a ClusterState step by step."""

    def __init__(self, rng: random.Random, lock_wait: float) -> None:
        self.rng = rng
        self.now = START
        self.state = ClusterState(
            lock_ttl=60.0, reservation_ttl=30.0, clock=lambda: self.now, lock_wait=lock_wait
        )
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.rv = 0
        self.serial = 0
        self.reserved: list[str] = []
        self.gone: dict[str, dict[str, Any]] = {}  # deleted nodes, as they were
        self.expected: set[str] = set()  # node names pods were assigned to before the node was seen

    # -- objects

    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        return obj

    def _gpus(self, name: str) -> list[dict[str, Any]] | None:
        rng = self.rng
        count = rng.choice([0, 1, 2, 4, 8, 8])
        mixed = rng.random() < 0.4
        base = rng.choice(MODELS)
        gpus = []
        for i in range(count):
            model, cc, mem = rng.choice(MODELS) if mixed else base
            gpus.append(
                gpu(
                    i,
                    f"GPU-{name}-{self.serial}-{i}",
                    model=model,
                    mem=mem,
                    cc=cc,
                    numa=i // 4,
                    healthy=rng.random() > 0.12,
                )
            )
        for g in gpus:
            if rng.random() < 0.08:
                g["mig"] = True  # MIG mode: the kubelet's, never placed on by the extender
        ids = [g["uuid"] for g in gpus]
        topology = rng.choice(["mesh", "mesh", "pairs", "none"])
        for i, g in enumerate(gpus):
            if topology == "mesh":
                peers = [p for p in ids if p != ids[i]]
            elif topology == "pairs":
                peers = [ids[i ^ 1]] if (i ^ 1) < len(ids) else []
            else:
                peers = []
            g["nvlink"] = {p: 12 for p in peers}
        self.serial += 1
        return gpus

    def _mode(self, sharing: float) -> dict[str, Any]:
        """The node's mode: memory sharing, whole GPUs, or devices the kubelet counts (time-slicing or
        MIG strategy single, which the extender lets pass)."""
        draw = self.rng.random()
        if draw < 0.06:
            return {"sharing": False, "labels": {"gpufleet.io/gpu-sharing": "time-slicing"}}
        if draw < 0.09:
            return {"sharing": False, "labels": {"nvidia.com/mig.strategy": "single"}}
        if draw < 0.11:  # labelled for memory sharing too: its devices are still MIG devices
            return {"sharing": True, "labels": {"gpufleet.io/mig.strategy": "single"}}
        return {"sharing": draw < sharing}

    def _lock(self) -> str | None:
        rng = self.rng
        choice = rng.random()
        if choice < 0.6:
            return None
        holders = list(self.pods.values())
        if choice < 0.75 and holders:
            holder = rng.choice(holders)["metadata"]
            uid, key = holder["uid"], f"{holder['namespace']}/{holder['name']}"
        elif choice < 0.8:
            uid, key = "uid-default-ask-0", "default/ask-0"  # a request's own lock
        else:
            uid, key = "uid-other", "default/other"
        taken = self.now - rng.choice([0, 1, 5, 30, 59, 70])
        return f"{uid} {key} {int(taken + 60)}"

    def add_node(self) -> None:
        name = f"n{len(self.nodes) + self.serial}"
        gpus = self._gpus(name)
        kind = self.rng.random()
        obj = node(name, gpus if kind > 0.05 else None, lock=self._lock(), **self._mode(0.75))
        if 0.05 < kind < 0.08:
            obj["metadata"]["annotations"]["gpufleet.io/gpus"] = "[{not json"
        self.nodes[name] = self._bump(obj)
        self.state.upsert_node(copy.deepcopy(obj))

    def update_node(self) -> None:
        if not self.nodes:
            return
        rng = self.rng
        name = rng.choice(sorted(self.nodes))
        obj = self.nodes[name]
        annotations = obj["metadata"]["annotations"]
        labels = obj["metadata"]["labels"]
        what = rng.random()
        if what < 0.3:  # the bind-lock comes or goes: same GPUs, the parse is reused
            lock = self._lock()
            if lock is None:
                annotations.pop("gpufleet.io/bind-lock", None)
            else:
                annotations["gpufleet.io/bind-lock"] = lock
        elif what < 0.33:  # a lock nobody can read (only extenders write it; it protects nothing)
            annotations["gpufleet.io/bind-lock"] = rng.choice(["garbage", "uid ns/name soon", ""])
        elif what < 0.45 and "gpufleet.io/gpus" in annotations:  # a GPU changes: health, size or model
            try:
                gpus = json.loads(annotations["gpufleet.io/gpus"])
            except ValueError:
                gpus = []
            if gpus:
                g = rng.choice(gpus)
                change = rng.random()
                if change < 0.6:
                    g["healthy"] = not g["healthy"]
                elif change < 0.8:
                    g["memory_gib"] = rng.choice([8, 16, 24, 40, 80])
                else:
                    g["model"], g["cc"], _ = rng.choice(MODELS)
                annotations["gpufleet.io/gpus"] = json.dumps(gpus)
        elif what < 0.5 and "gpufleet.io/gpus" in annotations:  # the same GPUs, serialized otherwise
            try:
                gpus = json.loads(annotations["gpufleet.io/gpus"])
            except ValueError:
                gpus = None
            if gpus is not None:
                annotations["gpufleet.io/gpus"] = json.dumps(
                    gpus, indent=rng.choice([None, 1]), sort_keys=True
                )
        elif what < 0.55:  # the GPUs annotation goes, breaks, or comes back
            if "gpufleet.io/gpus" in annotations and rng.random() < 0.5:
                if rng.random() < 0.5:
                    del annotations["gpufleet.io/gpus"]
                else:
                    annotations["gpufleet.io/gpus"] = "[{not json"
            else:
                annotations["gpufleet.io/gpus"] = json.dumps(self._gpus(name))
        elif what < 0.65:  # sharing switched on or off
            if "gpufleet.io/gpu-sharing" in labels:
                del labels["gpufleet.io/gpu-sharing"]
            else:
                labels["gpufleet.io/gpu-sharing"] = rng.choice(["memory", "memory", "none"])
        elif what < 0.72:  # labels the extender does not decide on: product (feature discovery), MPS, others
            key = rng.choice(["gpufleet.io/gpu.product", "gpufleet.io/mps", "nvidia.com/gpu.product", "zone"])
            if key in labels and rng.random() < 0.4:
                del labels[key]
            else:
                labels[key] = rng.choice(["NVIDIA-A100-SXM4-80GB", "Tesla-T4", "mixed", "true", "false", "a"])
        elif what < 0.8:  # new cards
            gpus = self._gpus(name)
            annotations["gpufleet.io/gpus"] = json.dumps(gpus)
        elif what < 0.9:  # other metadata: kubelet heartbeats, node-controller annotations
            annotations["node.alpha.kubernetes.io/ttl"] = str(rng.randint(0, 30))
        else:  # nothing but the resourceVersion
            pass
        self._bump(obj)
        self.state.upsert_node(copy.deepcopy(obj))
        if rng.random() < 0.05:  # a watch replays the event
            self.state.upsert_node(copy.deepcopy(obj))

    def delete_node(self) -> None:
        if not self.nodes:
            return
        name = self.rng.choice(sorted(self.nodes))
        obj = self.nodes.pop(name)
        self.gone[name] = obj
        self.state.delete_node(copy.deepcopy(obj))

    def recreate_node(self) -> None:
        """A deleted node comes back under its name (pods may still claim GPUs on it), or a node the pods
        named before the watch showed it appears: its labels and annotations arrive after the pods."""
        rng = self.rng
        names = sorted(self.gone) + sorted(self.expected - self.nodes.keys())
        if not names:
            return
        name = rng.choice(names)
        old = self.gone.pop(name, None)
        self.expected.discard(name)
        if old is not None and rng.random() < 0.6:
            obj = copy.deepcopy(old)  # the same GPUs again
        else:
            obj = node(name, self._gpus(name), lock=self._lock(), **self._mode(0.8))
        self.nodes[name] = self._bump(obj)
        self.state.upsert_node(copy.deepcopy(obj))

    def _node_gpus(self, name: str) -> list[dict[str, Any]]:
        obj = self.nodes.get(name) or self.gone.get(name)
        if obj is None:
            return []
        raw = obj["metadata"]["annotations"].get("gpufleet.io/gpus")
        try:
            return json.loads(raw) if raw else []
        except ValueError:
            return []

    def add_pod(self) -> None:
        rng = self.rng
        self.serial += 1
        name = f"p{self.serial}"
        names = sorted(self.nodes)
        kind = rng.random()
        if kind < 0.15 and names:  # whole GPUs, bound
            obj = pod(name, whole=rng.randint(1, 3), node_name=rng.choice(names), phase="Running")
        elif kind < 0.9 and names:  # GPU memory with an assignment: bound, or annotated and not bound yet
            target = rng.choice(names)
            if rng.random() < 0.06:  # a node the watch has not shown yet, or one deleted meanwhile
                target = rng.choice([*self.gone, f"late{self.serial}"])
                self.expected.add(target)
            gpus = self._node_gpus(target) or [{"uuid": "GPU-gone", "memory_gib": 16}]
            count = rng.choice([1, 1, 1, 2])
            chosen = rng.sample(gpus, min(count, len(gpus)))
            # Multiples of 8 often leave cards of different sizes equally free (ties in pick order).
            share = rng.choice([rng.randint(1, 50), 8 * rng.randint(1, 5)])
            gib = share * len(chosen)
            annotations = {"gpufleet.io/gpu-count": str(len(chosen))} if len(chosen) > 1 else {}
            bound = rng.random() < 0.85
            obj = pod(
                name,
                mem=[gib],
                annotations=annotations,
                node_name=target if bound else None,
                phase="Running" if bound else "Pending",
            )
            obj["metadata"]["annotations"]["gpufleet.io/assignment"] = json.dumps(
                {
                    "node": target,
                    "containers": [{"name": "c0", "gpu_mem_gib": gib, "gpus": [g["uuid"] for g in chosen]}],
                    "ts": self.now - rng.choice([0, 10, 50]),
                }
            )
        else:  # pending, not annotated: no claim
            obj = pod(name, mem=[rng.randint(1, 40)])
        self.pods[name] = self._bump(obj)
        self.state.upsert_pod(copy.deepcopy(obj))

    def change_pod(self) -> None:
        if not self.pods:
            return
        rng = self.rng
        name = rng.choice(sorted(self.pods))
        obj = self.pods[name]
        annotations = obj["metadata"]["annotations"]
        raw = annotations.get("gpufleet.io/assignment")
        what = rng.random()
        if what < 0.35:
            obj["status"]["phase"] = "Succeeded"
        elif what < 0.7:  # an annotated pod gets its Binding (or a bound one is seen again)
            if raw:
                obj["spec"]["nodeName"] = json.loads(raw)["node"]
        elif what < 0.8 and raw and not obj["spec"].get("nodeName"):  # a failed bind undone: no assignment
            del annotations["gpufleet.io/assignment"]
        elif what < 0.9 and raw and not obj["spec"].get("nodeName") and self.nodes:
            # Another replica's bind annotates it for another node (or other GPUs of the same node).
            target = rng.choice(sorted(self.nodes))
            doc = json.loads(raw)
            gpus = self._node_gpus(target) or [{"uuid": "GPU-gone"}]
            gib = doc["containers"][0]["gpu_mem_gib"]
            chosen = rng.sample(gpus, min(len(doc["containers"][0]["gpus"]), len(gpus)))
            share = gib // len(doc["containers"][0]["gpus"])
            doc["node"] = target
            doc["containers"][0]["gpus"] = [g["uuid"] for g in chosen]
            doc["containers"][0]["gpu_mem_gib"] = share * len(chosen)
            if len(chosen) > 1:
                annotations["gpufleet.io/gpu-count"] = str(len(chosen))
            else:
                annotations.pop("gpufleet.io/gpu-count", None)
            for c in obj["spec"]["containers"]:
                c["resources"] = {
                    "limits": {"gpufleet.io/gpu-mem": str(share * len(chosen))},
                    "requests": {"gpufleet.io/gpu-mem": str(share * len(chosen))},
                }
            doc["ts"] = self.now
            annotations["gpufleet.io/assignment"] = json.dumps(doc)
        elif raw and obj["spec"].get("nodeName"):  # the device plugin allocated it
            annotations["gpufleet.io/allocated"] = "c0"
        self._bump(obj)
        self.state.upsert_pod(copy.deepcopy(obj))
        if rng.random() < 0.05:  # a watch replays the event
            self.state.upsert_pod(copy.deepcopy(obj))

    def delete_pod(self) -> None:
        if not self.pods:
            return
        name = self.rng.choice(sorted(self.pods))
        self.state.delete_pod(copy.deepcopy(self.pods.pop(name)))

    def reserve(self) -> None:
        names = sorted(self.nodes)
        if not names:
            return
        rng = self.rng
        self.serial += 1
        req = parse_pod(pod(f"r{self.serial}", mem=[rng.randint(1, 30)]))
        entry = self.state.entry(rng.choice(names))
        if entry is not None and entry.info is not None:
            verdict = self.state.plan_and_reserve(req, entry.info, rng.choice(list(Policy)), self.now)
            if verdict.fits:
                self.reserved.append(req.uid)

    def end_reservation(self) -> None:
        if self.reserved:
            uid = self.reserved.pop(self.rng.randrange(len(self.reserved)))
            (self.state.settle if self.rng.random() < 0.5 else self.state.release)(uid)

    def bind(self) -> None:
        """A bind as the binder makes it, with the watch events it causes interleaved at random: reserve,
        maybe re-plan under the lock, annotate, Binding, settle — or fail and undo at any point."""
        rng = self.rng
        pending = [
            n for n, o in self.pods.items()
            if not o["spec"].get("nodeName") and "gpufleet.io/assignment" not in o["metadata"]["annotations"]
            and o["status"]["phase"] == "Pending"
        ]  # fmt: skip
        names = sorted(self.nodes)
        if not pending or not names:
            return
        name = rng.choice(pending)
        obj = self.pods[name]
        req = parse_pod(obj)
        if req.kind != "mem":
            return
        target = rng.choice(names)
        policy = rng.choice(list(Policy))
        entry = self.state.entry(target)
        if entry is None or entry.info is None:
            return
        verdict = self.state.plan_and_reserve(req, entry.info, policy, self.now)
        if verdict.placement is None:
            return
        placement = verdict.placement
        if rng.random() < 0.2:  # the re-check under the lock plans otherwise (another replica's binds)
            flipped = Policy.SPREAD if policy is Policy.BINPACK else Policy.BINPACK
            other = self.state.evaluate(req, entry.info, flipped, self.now)
            if other.placement is not None:
                placement = other.placement
                self.state.reserve(req, target, placement, self.now)
        outcome = rng.random()
        if outcome < 0.15:  # fails before annotating
            self.state.release(req.uid)
            return
        doc = {
            "node": target,
            "containers": [
                {"name": c.name, "gpu_mem_gib": c.gpu_mem_gib, "gpus": list(c.gpus)}
                for c in placement.containers
            ],
            "ts": self.now,
        }
        obj["metadata"]["annotations"]["gpufleet.io/assignment"] = json.dumps(doc)
        self._bump(obj)
        annotated = copy.deepcopy(obj)
        if rng.random() < 0.5:  # the watch shows the annotation before the bind goes on
            self.state.upsert_pod(copy.deepcopy(annotated))
        if outcome < 0.3:  # the Binding fails: the annotation is taken back, the reservation dropped
            del obj["metadata"]["annotations"]["gpufleet.io/assignment"]
            self._bump(obj)
            if rng.random() < 0.5:
                self.state.release(req.uid)
                self.state.upsert_pod(copy.deepcopy(obj))
            else:
                self.state.upsert_pod(copy.deepcopy(obj))
                self.state.release(req.uid)
            return
        obj["spec"]["nodeName"] = target
        obj["status"]["phase"] = "Running"
        self._bump(obj)
        if rng.random() < 0.5:  # the watch shows the pod bound before or after the bind settles
            self.state.upsert_pod(copy.deepcopy(obj))
            self.state.settle(req.uid)
        else:
            self.state.settle(req.uid)
            self.state.upsert_pod(copy.deepcopy(obj))

    def partial_relist(self) -> None:
        """A relist of one kind only (the node and pod watches relist independently)."""
        if self.rng.random() < 0.5:
            self.state.replace_nodes(copy.deepcopy(list(self.nodes.values())))
        else:
            self.state.replace_pods(copy.deepcopy(list(self.pods.values())))

    def tick(self) -> None:
        self.now += self.rng.choice([0.5, 5, 20, 45])
        self.state.sweep()

    def step(self) -> None:
        ops = [
            (self.add_node, 3),
            (self.update_node, 6),
            (self.delete_node, 1),
            (self.recreate_node, 1),
            (self.add_pod, 6),
            (self.change_pod, 3),
            (self.delete_pod, 2),
            (self.reserve, 2),
            (self.end_reservation, 1),
            (self.bind, 3),
            (self.partial_relist, 0.3),
            (self.tick, 1),
        ]
        op = self.rng.choices([o for o, _ in ops], weights=[w for _, w in ops])[0]
        op()

    def relist(self) -> None:
        """A watch relist: everything replaced at once (the index must come out the same)."""
        self.state.replace_nodes(copy.deepcopy(list(self.nodes.values())))
        self.state.replace_pods(copy.deepcopy(list(self.pods.values())))

    # -- requests

    def request(self, i: int) -> GpuRequest:
        rng = self.rng
        annotations: dict[str, str] = {}
        selector = None
        if rng.random() < 0.35:
            annotations["gpufleet.io/gpu-model"] = rng.choice(MODEL_WISHES)
        if rng.random() < 0.3:
            annotations["gpufleet.io/gpu-min-cc"] = rng.choice(CC_WISHES)
        if rng.random() < 0.1:
            selector = {"gpufleet.io/gpu.product": rng.choice(["NVIDIA-A100-SXM4-80GB", "Tesla-T4", "mixed"])}
        if rng.random() < 0.2:
            annotations["gpufleet.io/gpu-prefer"] = "most-capable"
        for key in ("gpufleet.io/node-policy", "gpufleet.io/gpu-policy"):
            if rng.random() < 0.3:
                annotations[key] = rng.choice(["binpack", "spread"])
        kind = rng.random()
        uid = None
        if kind < 0.08 and self.pods:  # a pod that already holds a claim (a retried bind)
            existing = rng.choice(sorted(self.pods))
            obj = copy.deepcopy(self.pods[existing])
            obj["metadata"]["annotations"].update(annotations)
            return parse_pod(obj)
        if kind < 0.55:
            share = rng.choice([1, 4, 8, 10, 16, 20, 24, 30, 40, 41, 60, 80, 81, 200])
            count = rng.choice([1, 1, 1, 2, 3, 4])
            if count > 1:
                annotations["gpufleet.io/gpu-count"] = str(count)
            spec: dict[str, Any] = {"mem": [share * count]}
        elif kind < 0.7:
            count = rng.choice([1, 2])
            if count > 1:
                annotations["gpufleet.io/gpu-count"] = str(count)
            spec = {"mem": [rng.randint(1, 30) * count for _ in range(rng.randint(2, 3))]}
            if rng.random() < 0.3:
                spec["init_mem"] = [rng.randint(1, 30) * count]
        elif kind < 0.95:
            spec = {"whole": rng.choice([1, 1, 2, 3, 8, 9])}
        else:
            spec = {}
        if rng.random() < 0.05:
            uid = "uid-default-ask-0"  # holds some nodes' locks
        return parse_pod(pod(f"ask-{i}", annotations=annotations, node_selector=selector, uid=uid, **spec))

    def candidates(self) -> list[Any]:
        rng = self.rng
        names = [*sorted(self.nodes), "ghost"]
        rng.shuffle(names)
        names = names[: rng.randint(1, len(names))]
        if rng.random() < 0.05:
            names.append(rng.choice(names))  # the scheduler never repeats one, but if it did
        if rng.random() < 0.75:
            return names
        # Full Node objects, some newer than the cache (the scheduler's informer is ahead of ours).
        out = []
        for name in names:
            obj = copy.deepcopy(self.nodes[name]) if name in self.nodes else node(name, None)
            if rng.random() < 0.2:
                obj["metadata"]["resourceVersion"] = "newer"
                obj["metadata"]["annotations"].pop("gpufleet.io/bind-lock", None)
            out.append(obj)
        return out


def reference_figures(
    state: ClusterState, req: GpuRequest, candidates: Sequence[Any], gpu_policy: Policy, now: float
) -> tuple[dict[str, Any], set[str]]:
    """Per fitting node, the Placement figures evaluate() makes (bit for bit), and who is handing off."""
    bare = not (req.whole > 1 or any(c.gpus > 1 for c in req.mem)) and not req.most_capable
    figures: dict[str, Any] = {}
    handing_off: set[str] = set()
    for name, info, _ in (_reference_info(state, c) for c in candidates):
        if info is None:
            continue
        p = state.evaluate(req, info, req.gpu_policy or gpu_policy, now).placement
        if p is None:
            continue
        figures[name] = p.utilization if bare else (p.utilization, p.topology, p.capability)
        entry = state.entry(name)
        if entry is not None and entry.lock_expires > now and entry.lock_uid != req.uid:
            handing_off.add(name)
    return figures, handing_off


def check_decisions(world: World, requests: int) -> None:
    state, now = world.state, world.now
    for i in range(requests):
        req = world.request(i)
        cands = world.candidates()
        gpu_policy = world.rng.choice(list(Policy))
        node_policy = world.rng.choice(list(Policy))
        if req.kind != "none":
            # Exact figures, not only the rounded scores: a float off by one ulp can flip a score.
            got_figures = placement_figures(state, req, cands, gpu_policy, now)
            assert got_figures == reference_figures(state, req, cands, gpu_policy, now), (req, cands)
        for _ in range(2):  # the second time reads whatever the first cached
            out = filter_nodes(state, req, cands, gpu_policy, now)
            want = reference_filter(state, req, cands, gpu_policy, now)
            assert (out.fits, out.failed, out.unresolvable, out.error) == want, (req, cands)
            got = prioritize_nodes(state, req, cands, node_policy, gpu_policy, now)
            assert got == reference_prioritize(state, req, cands, node_policy, gpu_policy, now), (req, cands)


@pytest.mark.parametrize("seed", range(6))
def test_index_and_decisions_match_a_brute_force_scan_over_random_histories(seed: int) -> None:
    rng = random.Random(seed)
    world = World(rng, lock_wait=0.0 if seed % 2 else 3.0)
    for _ in range(12):
        world.add_node()
    world.state.replace_pods([])
    for step in range(260):
        world.step()
        check_index(world.state)
        if step % 13 == 0:
            check_decisions(world, 4)
        if step % 97 == 96:
            world.relist()
            check_index(world.state)
    check_index(world.state)
    check_decisions(world, 10)


def _history(seed: int, nodes: int, steps: int, lock_wait: float) -> World:
    """A random history on `nodes` nodes, its reservations released (they live only in this process; a
    fresh state from the same objects has none)."""
    world = World(random.Random(seed), lock_wait=lock_wait)
    for _ in range(nodes):
        world.add_node()
    for _ in range(steps):
        world.step()
    for uid in list(world.reserved):
        world.state.release(uid)
    return world


def test_index_after_incremental_updates_equals_a_fresh_build() -> None:
    world = _history(42, 15, 400, lock_wait=3.0)
    # Settled reservations expire after reservation_ttl.
    world.now += 31
    world.state.sweep()
    assert world.state.reservation_count() == 0
    fresh = ClusterState(lock_ttl=60.0, reservation_ttl=30.0, clock=lambda: world.now, lock_wait=3.0)
    fresh.replace_nodes(copy.deepcopy(list(world.nodes.values())))
    fresh.replace_pods(copy.deepcopy(list(world.pods.values())))
    world.state.sweep()
    fresh.sweep()
    assert set(world.state.index) == set(fresh.index)
    for name in fresh.index:
        assert normalized_record(world.state, world.state.index[name]) == normalized_record(
            fresh, fresh.index[name]
        ), name
    assert world.state.maxima() == fresh.maxima()


@pytest.mark.parametrize("pods_first", [False, True])
def test_an_index_deferred_until_synced_equals_one_built_as_objects_arrive(pods_first: bool) -> None:
    """The extender's state builds its index once both first lists are in (each node once, however many
    pods it has), whichever list arrives first; until then nothing is indexed and the state is not synced."""
    world = _history(7, 12, 300, lock_wait=0.0)
    nodes, pods = list(world.nodes.values()), list(world.pods.values())
    eager = ClusterState(clock=lambda: world.now)
    deferred = ClusterState(clock=lambda: world.now, defer_index=True)
    for state in (eager, deferred):
        lists = [(state.replace_pods, pods), (state.replace_nodes, nodes)]
        for i, (replace, objs) in enumerate(lists[:: 1 if pods_first else -1]):
            replace(copy.deepcopy(objs))
            if i == 0:
                assert state.synced is False
                if state is deferred:
                    assert state.index == {}
    assert deferred.synced and not deferred.gpus.deferring
    assert set(deferred.index) == set(eager.index) and len(eager.index) >= 12
    for name in eager.index:
        assert normalized_record(deferred, deferred.index[name]) == normalized_record(
            eager, eager.index[name]
        )
    busy = [name for name, entry in eager.entries().items() if len(entry.pods) > 1]
    assert busy, "the history put several pods on some node"
    assert {deferred.entry(name).version for name in eager.index} == {1}  # type: ignore[union-attr]
    assert all(eager.entry(name).version > 1 for name in busy)  # type: ignore[union-attr]
    # After the sync, changes reach the index at once.
    node_obj = copy.deepcopy(nodes[0])
    node_obj["metadata"]["resourceVersion"] = "999999"
    node_obj["metadata"]["annotations"]["gpufleet.io/gpus"] = "[]"
    deferred.upsert_node(node_obj)
    assert deferred.index[node_obj["metadata"]["name"]].n == 0


def test_a_lock_change_reuses_the_gpu_parse_and_a_gpu_change_does_not() -> None:
    state = ClusterState(clock=lambda: START)
    obj = node("a", [gpu(0, "GPU-a-0"), gpu(1, "GPU-a-1", model="Tesla T4", mem=16, cc="7.5")])
    obj["metadata"]["resourceVersion"] = "1"
    state.upsert_node(obj)
    first = state.entry("a")
    assert first is not None and first.info is not None and first.shape is not None
    gpus, shape = first.info.gpus, first.shape
    locked = copy.deepcopy(obj)
    locked["metadata"]["resourceVersion"] = "2"
    locked["metadata"]["annotations"]["gpufleet.io/bind-lock"] = f"uid-x ns/x {int(START) + 30}"
    state.upsert_node(locked)
    entry = state.entry("a")
    assert entry is not None and entry.info is not None
    assert entry.info.gpus is gpus and entry.shape is shape and entry.lock_uid == "uid-x"
    assert state.index["a"].lock_expires == START + 30
    changed = copy.deepcopy(locked)
    changed["metadata"]["resourceVersion"] = "3"
    changed["metadata"]["annotations"]["gpufleet.io/gpus"] = json.dumps([gpu(0, "GPU-a-0", healthy=False)])
    state.upsert_node(changed)
    assert entry.info is not None and entry.info.gpus is not gpus and entry.shape is not shape
    assert state.index["a"].n == 0  # no healthy GPU left
    assert state.maxima() == (0, 0)


def test_a_constraint_is_decided_per_signature_and_mixed_nodes_per_kind() -> None:
    state = ClusterState(clock=lambda: START)
    mixed = [gpu(0, "GPU-m-0"), gpu(1, "GPU-m-1", model="Tesla T4", mem=16, cc="7.5")]
    state.replace_nodes(
        [node("a100", [gpu(0, "GPU-a-0"), gpu(1, "GPU-a-1")]), node("mixed", mixed), node("mixed2", mixed)]
    )
    state.replace_pods([])
    assert len(state.signatures.kinds) == 2  # both mixed nodes share one signature
    for wish, fits in (("A100", ["a100", "mixed", "mixed2"]), ("T4", ["mixed", "mixed2"]), ("H100", [])):
        r = parse_pod(pod("p", mem=[8], annotations={"gpufleet.io/gpu-model": wish}))
        names = ["a100", "mixed", "mixed2"]
        out = filter_nodes(state, r, names, Policy.BINPACK, START)
        assert out.fits == fits
        assert (out.fits, out.failed, out.unresolvable, out.error) == reference_filter(
            state, r, names, Policy.BINPACK, START
        )


def test_verdicts_are_shared_by_constraints_that_leave_the_same_gpus() -> None:
    # Two containers: decided by evaluate, cached per node by which GPUs the constraint leaves. A new
    # wish leaving the same GPUs reuses the verdict; one leaving none must not (its reason names it).
    rng = random.Random(7)
    world = World(rng, lock_wait=0.0)
    for _ in range(20):
        world.add_node()
    world.state.replace_pods([])
    for _ in range(60):
        world.add_pod()
    state, names = world.state, sorted(world.nodes)
    wishes = [{}, {"gpufleet.io/gpu-min-cc": "7.0"}, {"gpufleet.io/gpu-min-cc": "7.1"}]
    wishes += [{"gpufleet.io/gpu-model": m} for m in ("A100", "nvidia a100", "H100", "V100", "P100")]
    for wish in wishes * 2:
        r = parse_pod(pod("p", mem=[8, 8], annotations=wish))
        out = filter_nodes(state, r, names, Policy.BINPACK, world.now)
        want = reference_filter(state, r, names, Policy.BINPACK, world.now)
        assert (out.fits, out.failed, out.unresolvable, out.error) == want, wish
        got = prioritize_nodes(state, r, names, Policy.SPREAD, Policy.BINPACK, world.now)
        assert got == reference_prioritize(state, r, names, Policy.SPREAD, Policy.BINPACK, world.now)
    assert any(r.memo for r in state.index.values())


def test_a_pods_own_claim_is_never_kept_for_other_pods() -> None:
    # Two containers go to evaluate, whose outcomes are kept per node: the retried pod's own node (its
    # claim subtracted) must not leave an outcome another pod of the same shape would then read.
    state = ClusterState(clock=lambda: START)
    state.replace_nodes([node("n", [gpu(0, "GPU-n-0", mem=16)]), node("m", [gpu(0, "GPU-m-0", mem=16)])])
    mine = pod("mine", mem=[6, 6], node_name="n", phase="Running")
    mine["metadata"]["annotations"]["gpufleet.io/assignment"] = json.dumps(
        {
            "node": "n",
            "containers": [
                {"name": "c0", "gpu_mem_gib": 6, "gpus": ["GPU-n-0"]},
                {"name": "c1", "gpu_mem_gib": 6, "gpus": ["GPU-n-0"]},
            ],
            "ts": START,
        }
    )
    state.replace_pods([mine])
    retried, other = parse_pod(mine), parse_pod(pod("other", mem=[6, 6]))
    for r, fits in ((retried, ["n", "m"]), (other, ["m"]), (retried, ["n", "m"]), (other, ["m"])):
        out = filter_nodes(state, r, ["n", "m"], Policy.BINPACK, START)
        assert out.fits == fits
        assert (out.fits, out.failed, out.unresolvable, out.error) == reference_filter(
            state, r, ["n", "m"], Policy.BINPACK, START
        )
        assert prioritize_nodes(state, r, ["n", "m"], Policy.BINPACK, Policy.BINPACK, START) == (
            reference_prioritize(state, r, ["n", "m"], Policy.BINPACK, Policy.BINPACK, START)
        )


def test_reads_under_the_lock_see_the_index_and_the_ledger_agree_while_other_threads_change_them() -> None:
    """The watch, the binder and the sweeper change the state on their threads while HTTP threads read
    it. Every change rebuilds the records under the state's lock and filter and prioritize read under
    it, so a read never sees a record from before a change it sees in the ledger: here one thread
    replays a random history while others, holding the lock as the verbs do, compare every record with
    a fresh build and the decisions with the brute-force scan. Threads switch far more often than usual."""
    world = World(random.Random(11), lock_wait=3.0)
    for _ in range(12):
        world.add_node()
    world.state.replace_pods([])
    state = world.state
    requests = World(random.Random(12), lock_wait=3.0)  # only generates requests (it holds no pods)
    done = threading.Event()
    errors: list[BaseException] = []
    reads = [0]

    def write() -> None:
        try:
            for step in range(500):
                world.step()
                if step % 150 == 149:
                    world.relist()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done.set()

    def read(seed: int) -> None:
        rng = random.Random(seed)
        i = 0
        try:
            while not done.is_set():
                i += 1
                req = requests.request(i)
                policy, node_policy = rng.choice(list(Policy)), rng.choice(list(Policy))
                with state.lock:
                    now = world.now
                    check_index(state)
                    names = [*state.entries(), "ghost"]
                    cands = rng.sample(names, rng.randint(1, len(names)))
                    out = filter_nodes(state, req, cands, policy, now)
                    want = reference_filter(state, req, cands, policy, now)
                    assert (out.fits, out.failed, out.unresolvable, out.error) == want, (req, cands)
                    got = prioritize_nodes(state, req, cands, node_policy, policy, now)
                    assert got == reference_prioritize(state, req, cands, node_policy, policy, now), req
                reads[0] += 1
        except BaseException as exc:
            errors.append(exc)
            done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=write)] + [
            threading.Thread(target=read, args=(s,)) for s in (1, 2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
    assert reads[0] > 20
    check_index(state)
