"""The extender's replies to a fixed set of scheduler requests: a change must leave them byte-identical.

    .venv/bin/python bench/extender_replies.py --record /tmp/after.jsonl
    PYTHONPATH=OLD/src .venv/bin/python bench/extender_replies.py --record /tmp/before.jsonl
    .venv/bin/python bench/extender_replies.py --compare /tmp/before.jsonl

Two clusters, each served by an `Extender` on the in-memory API with a fixed clock:

- the benches' cluster (`extender_bench.cluster_objects`, N nodes x 8 NVSwitch-connected A100s, about
  half the GPUs partly used) with every request kind `extender_bench.py` times (10 GiB, model and
  capability wishes, 2 GPUs, 2 containers, GiB sizes never seen, whole GPUs, "most capable", the first
  call after a relist) and `extender_http_bench.py`'s pod, as names and as Node objects;
- a varied one (seeded): mixed models, 0-8 GPUs, unhealthy and MIG GPUs, meshed or not, whole-GPU,
  time-sliced and MIG-single nodes, GPUs annotations missing or malformed, live, expired and other pods'
  bind-locks, assigned, binding and whole-GPU pods; random requests of every kind on random candidate
  subsets, some as Node objects newer than the cache.

Every request is sent as filter (`filter_json`) then prioritize (`prioritize_json`), in order; filter
decides GPU-memory pods and reserves their placement, so later replies depend on earlier ones as in a
burst. `filter_wait` is 0 (a waiting filter would depend on wall time). Each reply is one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpufleet.extender.service import Extender
from gpufleet.extender.settings import Settings
from gpufleet_harness.memapi import InMemoryCluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extender_bench import COLD_CC, args_body, args_body2, cluster_objects, make_pod, whole_pod

NOW = 1_700_000_000.0

MODELS = [
    ("NVIDIA A100-SXM4-80GB", "8.0", 80),
    ("NVIDIA A100-PCIE-40GB", "8.0", 40),
    ("Tesla T4", "7.5", 16),
    ("NVIDIA H100 80GB HBM3", "9.0", 80),
    ("NVIDIA A10", "8.6", 24),
]


def extender(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> Extender:
    cluster = InMemoryCluster()
    for obj in nodes:
        cluster.add_node(obj)
    for obj in pods:
        cluster.add_pod(obj)
    ext = Extender(Settings(filter_wait=0), cluster, clock=lambda: NOW)
    ext.start()
    assert ext.wait_synced(300), "the extender did not sync"
    return ext


def bench_cases(n: int) -> Iterator[tuple[str, Callable[[Extender], None] | bytes]]:
    """extender_bench.py's request kinds and extender_http_bench.py's pod on its cluster."""
    nodes, _ = cluster_objects(n)
    names = [o["metadata"]["name"] for o in nodes]
    model = {"gpufleet.io/gpu-model": "A100"}
    yield "10GiB", args_body(names, 10)
    for cc in COLD_CC[:8]:
        yield f"model+cc {cc}", args_body(names, 10, {**model, "gpufleet.io/gpu-min-cc": cc})
    yield "model+cc warm", args_body(names, 10, {**model, "gpufleet.io/gpu-min-cc": COLD_CC[0]})
    yield "2-GPU", args_body(names, 20, {"gpufleet.io/gpu-count": "2"})
    for cc in COLD_CC[:4]:
        yield f"cc {cc}", args_body(names, 10, {"gpufleet.io/gpu-min-cc": cc})
        two = {"gpufleet.io/gpu-count": "2", "gpufleet.io/gpu-min-cc": cc}
        yield f"2-GPU cc {cc}", args_body(names, 20, two)
        yield f"2 containers cc {cc}", args_body2(names, (10, 10), {"gpufleet.io/gpu-min-cc": cc})
        capable = {"gpufleet.io/gpu-prefer": "most-capable", "gpufleet.io/gpu-min-cc": cc}
        yield f"most capable cc {cc}", args_body(names, 10, capable)
    for i in range(6):
        yield f"2 containers new sizes {i}", args_body2(names, (10 + i, 10))
        yield f"new GiB {i}", args_body(names, 10 + i)
    yield "whole GPU", json.dumps({"Pod": whole_pod(1), "NodeNames": names}).encode()
    yield (
        "spread",
        args_body(names, 30, {"gpufleet.io/node-policy": "spread", "gpufleet.io/gpu-policy": "spread"}),
    )
    yield "too big", args_body(names, 81)
    yield "3 GPUs", args_body(names, 90, {"gpufleet.io/gpu-count": "3"})
    objects = {"Pod": make_pod("ask-objects", 10), "Nodes": {"items": nodes[: max(1, n // 4)]}}
    yield "Nodes mode", json.dumps(objects).encode()

    def relist(ext: Extender) -> None:
        ext.state.replace_nodes(copy.deepcopy(nodes))

    yield "relist", relist
    yield "model+cc relisted", args_body(names, 10, {**model, "gpufleet.io/gpu-min-cc": COLD_CC[1]})
    for i in range(40):  # a burst of distinct pods: each filter decides and reserves
        yield f"burst {i}", json.dumps({"Pod": make_pod(f"burst-{i}", 16), "NodeNames": names}).encode()
    yield "http bench pod", args_body(names, 10)


def gpu_entry(
    rng: random.Random, name: str, i: int, kind: tuple[str, str, int], ids: list[str], mesh: bool
) -> dict[str, Any]:
    model, cc, mem = kind
    peers = [p for p in ids if p != ids[i]] if mesh else ([ids[i ^ 1]] if i ^ 1 < len(ids) else [])
    entry: dict[str, Any] = {
        "index": i,
        "uuid": ids[i],
        "model": model,
        "memory_gib": mem,
        "cc": cc,
        "numa": i // 4,
        "healthy": rng.random() > 0.1,
        "nvlink": {p: 12 for p in peers},
    }
    if rng.random() < 0.04:
        entry["mig"] = True
    return entry


def varied_node(rng: random.Random, i: int) -> dict[str, Any]:
    name = f"v{i:04d}"
    count = rng.choice([0, 1, 2, 4, 4, 8, 8, 8])
    ids = [f"GPU-{name}-{g}" for g in range(count)]
    base = rng.choice(MODELS)
    mixed = rng.random() < 0.3
    mesh = rng.random() < 0.6
    gpus = [gpu_entry(rng, name, g, rng.choice(MODELS) if mixed else base, ids, mesh) for g in range(count)]
    labels = {"kubernetes.io/hostname": name}
    kind = rng.random()
    if kind < 0.6:
        labels["gpufleet.io/gpu-sharing"] = "memory"
    elif kind < 0.66:
        labels["gpufleet.io/gpu-sharing"] = "time-slicing"
    elif kind < 0.7:
        labels["nvidia.com/mig.strategy"] = "single"
    annotations: dict[str, str] = {}
    which = rng.random()
    if which < 0.04:
        pass  # no GPUs annotation
    elif which < 0.07:
        annotations["gpufleet.io/gpus"] = '[{"index": "x"}]'
    else:
        annotations["gpufleet.io/gpus"] = json.dumps(gpus)
    lock = rng.random()
    if lock < 0.08:
        annotations["gpufleet.io/bind-lock"] = f"uid-holder-{i} team/holder-{i} {int(NOW) + 40}"
    elif lock < 0.12:
        annotations["gpufleet.io/bind-lock"] = f"uid-gone-{i} team/gone-{i} {int(NOW) - 5}"
    elif lock < 0.16:
        annotations["gpufleet.io/bind-lock"] = f"uid-ask-7 team/ask-7 {int(NOW) + 20}"
    return {
        "metadata": {
            "name": name,
            "resourceVersion": str(1000 + i),
            "labels": labels,
            "annotations": annotations,
        },
        "spec": {},
        "status": {},
    }


def varied_pods(rng: random.Random, nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    pods = []
    for k, obj in enumerate(nodes):
        name = obj["metadata"]["name"]
        annotations = obj["metadata"]["annotations"]
        raw = annotations.get("gpufleet.io/gpus", "")
        try:
            gpus = [g for g in json.loads(raw) if g.get("healthy") and not g.get("mig")]
        except (ValueError, AttributeError):
            gpus = []
        lock = annotations.get("gpufleet.io/bind-lock", "")
        if lock.startswith("uid-holder"):  # the lock's holder, bound and not yet allocated
            gib = 4
            pod = make_pod(f"holder-{k}", gib, name, gpus[0]["uuid"] if gpus else "GPU-none")
            pod["metadata"].update(namespace="team", uid=f"uid-holder-{k}")
            pods.append(pod)
        sharing = obj["metadata"]["labels"].get("gpufleet.io/gpu-sharing") == "memory"
        for g in gpus:
            if rng.random() < 0.5:
                continue
            if sharing:
                gib = rng.randint(1, g["memory_gib"])
                pod = make_pod(f"p{k}-{g['index']}", gib, name, g["uuid"])
                if rng.random() < 0.1:  # annotated, not bound yet: a bind in flight
                    pod["spec"].pop("nodeName")
                    pod["status"]["phase"] = "Pending"
                    doc = json.loads(pod["metadata"]["annotations"]["gpufleet.io/assignment"])
                    doc["ts"] = NOW - 10
                    pod["metadata"]["annotations"]["gpufleet.io/assignment"] = json.dumps(doc)
                pods.append(pod)
        whole = rng.choice([0, 0, 1, 2]) if gpus else 0
        if whole and (not sharing or rng.random() < 0.1):
            pod = make_pod(f"w{k}", 1, None, None)
            pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": str(whole)}}
            pod["spec"]["nodeName"] = name
            pod["status"]["phase"] = "Running"
            pods.append(pod)
    return pods


def varied_request(rng: random.Random, i: int) -> dict[str, Any]:
    annotations: dict[str, str] = {}
    if rng.random() < 0.35:
        annotations["gpufleet.io/gpu-model"] = rng.choice(
            ["A100", "T4, H100", "A100 80GB", "A10", "H100", "V100"]
        )
    if rng.random() < 0.3:
        annotations["gpufleet.io/gpu-min-cc"] = rng.choice(["7.0", "7.5", "8.0", "8.6", "9.0", "9.5"])
    if rng.random() < 0.2:
        annotations["gpufleet.io/gpu-prefer"] = "most-capable"
    for key in ("gpufleet.io/node-policy", "gpufleet.io/gpu-policy"):
        if rng.random() < 0.3:
            annotations[key] = rng.choice(["binpack", "spread"])
    kind = rng.random()
    uid = "uid-ask-7" if rng.random() < 0.05 else f"uid-ask-{i}"
    pod = make_pod(f"ask-{i}", 1, annotations=annotations)
    pod["metadata"]["uid"] = uid
    if kind < 0.55:
        share = rng.choice([1, 4, 8, 10, 16, 20, 24, 30, 40, 41, 60, 80, 81])
        count = rng.choice([1, 1, 1, 2, 3, 4])
        if count > 1:
            annotations["gpufleet.io/gpu-count"] = str(count)
        limits = [share * count]
    elif kind < 0.72:
        count = rng.choice([1, 2])
        if count > 1:
            annotations["gpufleet.io/gpu-count"] = str(count)
        limits = [rng.randint(1, 30) * count for _ in range(rng.randint(2, 3))]
    elif kind < 0.95:
        limits = []
        pod["spec"]["containers"][0]["resources"] = {
            "limits": {"nvidia.com/gpu": str(rng.choice([1, 1, 2, 3, 8, 9]))}
        }
    else:
        limits = []
        pod["spec"]["containers"][0]["resources"] = {}
    if limits:
        first = pod["spec"]["containers"][0]
        pod["spec"]["containers"] = [
            {**first, "name": f"c{j}", "resources": {"limits": {"gpufleet.io/gpu-mem": str(g)}}}
            for j, g in enumerate(limits)
        ]
    pod["metadata"]["annotations"] = annotations
    return pod


def varied_cases(n: int, requests: int) -> Iterator[tuple[str, Callable[[Extender], None] | bytes]]:
    rng = random.Random(36)
    nodes = [varied_node(rng, i) for i in range(n)]
    names = [o["metadata"]["name"] for o in nodes]
    for i in range(requests):
        pod = varied_request(rng, i)
        chosen = rng.sample([*names, "ghost"], rng.randint(1, len(names) + 1))
        if rng.random() < 0.7:
            yield f"varied {i} names", json.dumps({"Pod": pod, "NodeNames": chosen}).encode()
            continue
        by_name = {o["metadata"]["name"]: o for o in nodes}
        items = []
        for name in chosen:
            obj = copy.deepcopy(by_name.get(name) or {"metadata": {"name": name}})
            if rng.random() < 0.2:
                obj["metadata"]["resourceVersion"] = "newer"
                obj["metadata"].setdefault("annotations", {}).pop("gpufleet.io/bind-lock", None)
            items.append(obj)
        yield f"varied {i} objects", json.dumps({"Pod": pod, "Nodes": {"items": items}}).encode()


def varied_cluster(n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rng = random.Random(36)
    nodes = [varied_node(rng, i) for i in range(n)]
    return nodes, varied_pods(random.Random(37), nodes)


def replies(bench_nodes: int, varied_nodes: int, varied_requests: int) -> Iterator[dict[str, Any]]:
    worlds = [
        ("bench", cluster_objects(bench_nodes), bench_cases(bench_nodes)),
        ("varied", varied_cluster(varied_nodes), varied_cases(varied_nodes, varied_requests)),
    ]
    for world, (nodes, pods), cases in worlds:
        ext = extender(nodes, pods)
        try:
            for label, case in cases:
                if callable(case):
                    case(ext)
                    continue
                request = json.loads(case)
                for verb, call in (("filter", ext.api.filter_json), ("prioritize", ext.api.prioritize_json)):
                    reply = call(copy.deepcopy(request))
                    yield {
                        "world": world,
                        "case": label,
                        "verb": verb,
                        "request": hashlib.sha256(case).hexdigest()[:16],
                        "reply": reply.decode(),
                    }
        finally:
            ext.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench-nodes", type=int, default=1000)
    parser.add_argument("--varied-nodes", type=int, default=200)
    parser.add_argument("--varied-requests", type=int, default=600)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--record", type=Path, help="write the replies here, one JSON line each")
    what.add_argument("--compare", type=Path, help="compare the replies with those recorded here")
    args = parser.parse_args()
    got = list(replies(args.bench_nodes, args.varied_nodes, args.varied_requests))
    if args.record:
        args.record.write_text("".join(json.dumps(line, sort_keys=True) + "\n" for line in got))
        print(f"{len(got)} replies recorded in {args.record}")
        return 0
    want = [json.loads(line) for line in args.compare.read_text().splitlines()]
    differ = [(w, g) for w, g in zip(want, got, strict=False) if w != g]
    for w, g in differ[:5]:
        print(
            f"differs: {w['world']} {w['case']} {w['verb']}\n"
            f"  was {w['reply'][:300]}\n  now {g['reply'][:300]}"
        )
    same = len(want) == len(got) and not differ
    print(
        f"{len(got)} replies, {len(want)} recorded: {'byte-identical' if same else f'{len(differ)} differ'}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
