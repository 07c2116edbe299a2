"""What `GET /inspect` shows: per node its GPUs, GiB used and free, which pods hold what, its bind-lock;
and cluster-wide totals. Built from the watch cache, the GPU ledger and the reservations (JSON-ready)."""

from __future__ import annotations

from typing import Any

from gpufleet.extender.bindlocks import BindLocks
from gpufleet.extender.ledger import GpuLedger, NodeEntry
from gpufleet.extender.watchcache import WatchCache


def cluster(watch: WatchCache, ledger: GpuLedger, locks: BindLocks, now: float) -> dict[str, Any]:
    """Every node plus cluster totals."""
    return {
        "synced": watch.synced,
        "watch_error": watch.watch_error,
        "reservations": len(locks.reservations),
        "totals": ledger.totals(),
        # GPU-memory pods bound without (or against) an assignment: the device plugin refuses them.
        "unassigned_gpu_mem_pods": watch.unassigned_gpu_mem_pods(),
        # Watched pods and nodes whose GPU request or annotations cannot be read (logged once each).
        "rejected_objects": watch.complaints.summary(),
        "nodes": {name: node(e, now) for name, e in sorted(ledger.entries.items())},
    }


def node(entry: NodeEntry, now: float) -> dict[str, Any]:
    """One node's GPUs, memory used/free and which pods hold what."""
    info = entry.info
    per_gpu: dict[str, list[dict[str, Any]]] = {}
    for usage in entry.pods.values():
        for container in usage.containers:
            for uuid, gib in container.shares().items():
                per_gpu.setdefault(uuid, []).append(
                    {
                        "pod": usage.key,
                        "uid": usage.uid,
                        "container": container.name,
                        "gib": gib,
                        "status": usage.status,
                    }
                )
    gpus = []
    known = set()
    for gpu in info.gpus if info else ():
        known.add(gpu.uuid)
        used = entry.used.get(gpu.uuid, 0)
        gpus.append(
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "model": gpu.model,
                "memory_gib": gpu.memory_gib,
                "cc": f"{gpu.cc[0]}.{gpu.cc[1]}",
                "healthy": gpu.healthy,
                # MIG mode: its MIG devices (nvidia.com/mig-*) are the kubelet's; nothing is placed here
                "mig": gpu.mig,
                "used_gib": used,
                "free_gib": max(0, gpu.memory_gib - used) if gpu.healthy and not gpu.mig else 0,
                "pods": per_gpu.get(gpu.uuid, []),
            }
        )
    lock = info.lock if info else None
    return {
        "known": info is not None,
        "sharing": bool(info and info.sharing),
        # why the kubelet alone counts the node's nvidia.com/gpu devices (time-slicing, MIG single), or null
        "left_to_kubelet": (info.passthrough or None) if info else None,
        "mps": bool(info and info.mps),
        "error": info.gpu_error if info else "node not in the extender's cache",
        "bind_lock": (
            {"pod": lock.pod_key, "uid": lock.pod_uid, "expires": lock.expires, "live": lock.live(now)}
            if lock
            else None
        ),
        "gpus": gpus,
        # Claims on GPUs the node no longer publishes (replaced or renamed cards).
        "orphans": {u: per_gpu[u] for u in per_gpu if u not in known},
        "whole_gpus_held": entry.whole,
        "whole_gpu_pods": sorted(u.key for u in entry.pods.values() if u.whole),
        "utilization": round(entry.util, 4),
    }
