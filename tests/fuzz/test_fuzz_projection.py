"""The extender keeps only the fields its readers use (`watchcache.project`): a projected Node or Pod must
read exactly as the whole object, whatever the object carries, valid or not."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import JSON_VALUES, maybe

from gpufleet.extender.model import node_info
from gpufleet.extender.watchcache import NODE_FIELDS, POD_FIELDS, pod_record, project

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "extender"))
from extender_builders import machine, node, pod

# Fields a real API server adds that no reader looks at, at every level the projection walks.
EXTRA = st.dictionaries(
    st.sampled_from(["managedFields", "ownerReferences", "images", "conditions", "volumes", "x"]),
    JSON_VALUES,
    max_size=3,
)


def _outcome(read: Any, obj: Any) -> Any:
    try:
        return ("ok", read(obj))
    except ValueError as exc:
        return ("error", str(exc))


def _sprinkle(obj: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    """Unread extra fields added at the top, in metadata, spec, status and each container."""
    obj = copy.deepcopy(obj)
    obj.update(data.draw(EXTRA))
    for part in ("metadata", "spec", "status"):
        if isinstance(obj.get(part), dict):
            obj[part].update(data.draw(EXTRA))
    for group in ("containers", "initContainers"):
        for container in (obj.get("spec") or {}).get(group) or []:
            container.update(data.draw(EXTRA))
    return obj


def _damage(obj: dict[str, Any], data: st.DataObject, paths: list[tuple[str, ...]]) -> dict[str, Any]:
    """Maybe replace one read field (or the object holding it) with any JSON value."""
    path = data.draw(st.sampled_from(paths))
    target: Any = obj
    for key in path[:-1]:
        if not isinstance(target, dict) or not isinstance(target.get(key), dict | list):
            return obj
        target = target[key] if isinstance(target[key], dict) else target[key][0] if target[key] else {}
    if isinstance(target, dict):
        target[path[-1]] = data.draw(maybe(st.just(target.get(path[-1]))))
    return obj


NODE_PATHS = [("metadata",), ("metadata", "name"), ("metadata", "labels"), ("metadata", "annotations")]
POD_PATHS = [
    ("metadata",), ("metadata", "uid"), ("metadata", "annotations"), ("spec",), ("spec", "nodeName"),
    ("spec", "containers"), ("spec", "containers", "resources"), ("spec", "initContainers"),
    ("spec", "nodeSelector"), ("status",), ("status", "phase"),
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(data=st.data(), gpus=st.integers(0, 8), sharing=st.booleans())
def test_a_projected_node_reads_as_the_whole_node(data: st.DataObject, gpus: int, sharing: bool) -> None:
    whole = _damage(_sprinkle(node("n1", machine("n1", gpus) if gpus else None, sharing=sharing), data), data,
                    NODE_PATHS)  # fmt: skip
    assert _outcome(node_info, project(whole, NODE_FIELDS)) == _outcome(node_info, whole)


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    mem=st.lists(st.integers(1, 80), max_size=3),
    whole_gpus=st.integers(0, 4),
    init_mem=st.lists(st.integers(1, 80), max_size=2),
    bound=st.booleans(),
    phase=st.sampled_from(["Pending", "Running", "Succeeded", "Failed"]),
)
def test_a_projected_pod_reads_as_the_whole_pod(
    data: st.DataObject, mem: list[int], whole_gpus: int, init_mem: list[int], bound: bool, phase: str
) -> None:
    annotations = {"gpufleet.io/assignment": '{"node": "n1", "containers": [], "ts": 1}'} if bound else {}
    obj = pod("p", mem=mem, whole=whole_gpus, init_mem=init_mem, annotations=annotations, phase=phase,
              node_name="n1" if bound else None, node_selector={"gpufleet.io/gpu-model": "A100"})  # fmt: skip
    whole = _damage(_sprinkle(obj, data), data, POD_PATHS)
    assert pod_record(project(whole, POD_FIELDS)) == pod_record(whole)


def test_projection_drops_what_no_reader_uses() -> None:
    obj = _sprinkle(pod("p", mem=[4]), _Fixed())  # type: ignore[arg-type]
    cut = project(obj, POD_FIELDS)
    assert "managedFields" not in cut and "x" not in cut["spec"]
    assert "image" not in cut["spec"]["containers"][0] and "x" not in cut["spec"]["containers"][0]
    assert cut["spec"]["containers"][0]["resources"] == obj["spec"]["containers"][0]["resources"]


class _Fixed:
    """A stand-in for hypothesis' data object: always draws the same extra fields."""

    def draw(self, _strategy: Any) -> dict[str, Any]:
        return {"managedFields": [{"manager": "kubelet"}], "x": 1}
