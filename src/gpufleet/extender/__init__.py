"""The GPU scheduler extender: filter, prioritize and bind for GPU-memory and whole-GPU pods.

Rooms: `model` (annotations, GPUs, lock, assignment), `request` (what a pod asks), `placement` (one node,
pure), `scheduling` (many nodes, scores), `state` (watch-fed cache and ledger), `binder` (the bind
sequence), `api` (extender wire protocol), `server` (HTTP), `cluster` / `kube` / `memory` (API access),
`schedconfig` (KubeSchedulerConfiguration), `settings`, `cli`. See docs/extender.md.
"""
