"""The GPU scheduler extender: filter, prioritize and bind for GPU-memory and whole-GPU pods.

Rooms: `model` (annotations, GPUs, lock, assignment), `request` (what a pod asks), `rules` (fit, card pick,
utilisation, score), `index` (each node's record, kept current), `placement` (one node's decision, pure:
the reference and the same on index records), `scheduling` (many nodes, scores, filter's choice), `state`
(watch-fed cache and ledger), `binder` (the bind sequence), `api` (extender wire protocol), `server`
(HTTP), `cluster` / `kube` / `memory` (API access), `schedconfig` (KubeSchedulerConfiguration),
`settings`, `cli`. See docs/extender.md.
"""
