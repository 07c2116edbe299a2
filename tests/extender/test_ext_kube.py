"""`KubeCluster` — the real `kubernetes` client code path — against a fake API server over HTTP."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest
from extender_builders import machine, node, pod

from gpufleet.extender.cluster import ConflictError, InvalidError, NotFoundError, UnavailableError
from gpufleet.extender.kube import NODE_LIST_ACCEPT, KubeCluster, _Listing
from gpufleet.extender.service import Extender
from gpufleet.extender.settings import Settings
from gpufleet_harness.fakeapi import FakeApiServer, extender_command


def kube_cluster(url: str, **kwargs: object) -> KubeCluster:
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = url
    return KubeCluster(client.ApiClient(configuration), timeout=5.0, **kwargs)  # type: ignore[arg-type]


def listed(source: KubeCluster, kind: str) -> tuple[list[dict[str, object]], str]:
    """The whole list of `kind` as the watch reads it (`_Listing`), and its resourceVersion."""
    listing = _Listing(source, kind)
    items = list(listing)
    return items, listing.version


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.fixture
def fake(cluster) -> Iterator[FakeApiServer]:  # type: ignore[no-untyped-def]
    cluster.add_node(node("n1", machine("a", 2, mem=16)))
    cluster.add_node(node("w1", machine("w", 2), sharing=False))
    cluster.add_pod(pod("p", mem=[6]))
    server = FakeApiServer(cluster)
    yield server
    server.close()


@pytest.fixture
def kube_extender(fake, clock) -> Iterator[Extender]:  # type: ignore[no-untyped-def]
    ext = Extender(Settings(), kube_cluster(fake.url, watch_timeout=1), clock)
    ext.start()
    assert ext.wait_synced(10)
    yield ext
    ext.stop()


def test_lists_are_read_page_by_page_and_cut_to_what_decisions_read(fake, cluster) -> None:  # type: ignore[no-untyped-def]
    for i in range(4):
        cluster.add_node(node(f"m{i}", machine(f"m{i}", 1)))
    source = kube_cluster(fake.url, page_size=2)
    nodes, version = listed(source, "nodes")
    assert sorted(n["metadata"]["name"] for n in nodes) == ["m0", "m1", "m2", "m3", "n1", "w1"]
    assert version == cluster.snapshot()[2]
    lists = [path for m, path, _, _ in fake.requests if m == "GET"]
    assert len(lists) == 3, lists  # three pages of two
    # only what node_info reads is kept: no spec, no status, no other metadata
    assert {key for n in nodes for key in n} == {"metadata"}
    kept = {key for n in nodes for key in n["metadata"]}
    assert kept <= {"name", "resourceVersion", "labels", "annotations"}, kept


def test_next_page_is_fetched_while_the_reader_works_on_the_one_before(fake, cluster) -> None:  # type: ignore[no-untyped-def]
    for i in range(4):
        cluster.add_node(node(f"m{i}", machine(f"m{i}", 1)))
    listing = _Listing(kube_cluster(fake.url, page_size=2), "nodes")
    names = []
    for obj in listing:
        if not names:
            # Still on the first object of the first page: the second page is asked for all the same.
            eventually(lambda: any("continue=" in path for path, _ in fake.accepts))
        names.append(obj["metadata"]["name"])
    assert sorted(names) == ["m0", "m1", "m2", "m3", "n1", "w1"]
    assert listing.version == cluster.snapshot()[2]


def test_a_list_failing_halfway_reaches_the_reader_and_drops_nothing(fake, cluster, clock) -> None:  # type: ignore[no-untyped-def]
    for i in range(4):
        cluster.add_node(node(f"m{i}", machine(f"m{i}", 1)))

    class Failing(KubeCluster):
        pages = 0

        def _page(self, kind: str, token: str | None) -> tuple[list[dict[str, object]], str | None, str]:
            self.pages += 1
            if self.pages == 2:
                raise UnavailableError("list nodes: connection reset")
            return super()._page(kind, token)

    failing = Failing(kube_cluster(fake.url).api_client, page_size=2)
    ext = Extender(Settings(), kube_cluster(fake.url), clock)
    ext.state.replace_nodes([node("gone", machine("g", 1))])
    with pytest.raises(UnavailableError, match="connection reset"):
        ext.state.replace_nodes(_Listing(failing, "nodes"))
    # The first page is in, and nothing was dropped; the relist that follows completes it.
    assert len(ext.state.entries()) == 3 and "gone" in ext.state.entries()
    ext.state.replace_nodes(_Listing(kube_cluster(fake.url, page_size=2), "nodes"))
    assert sorted(ext.state.entries()) == ["m0", "m1", "m2", "m3", "n1", "w1"]


def test_stand_in_lists_each_change_though_it_encodes_an_object_once_per_version(fake, cluster) -> None:  # type: ignore[no-untyped-def]
    source = kube_cluster(fake.url)
    listed(source, "nodes")
    listed(source, "pods")
    before = fake.encodings[("pods", False)][("default", "p")]
    cluster.update_node("n1", lambda n: n["metadata"]["labels"].update(changed="yes"))
    cluster.set_pod_phase("default", "p", "Succeeded")
    nodes, _ = listed(source, "nodes")
    pods, _ = listed(source, "pods")
    assert next(n for n in nodes if n["metadata"]["name"] == "n1")["metadata"]["labels"]["changed"] == "yes"
    assert [p["status"]["phase"] for p in pods] == ["Succeeded"]
    after = fake.encodings[("pods", False)][("default", "p")]
    assert after[0] == pods[0]["metadata"]["resourceVersion"] != before[0]
    # An unchanged object is not encoded again: the same text object is served.
    w1 = fake.encodings[("nodes", True)][("", "w1")]
    listed(source, "nodes")
    assert fake.encodings[("nodes", True)][("", "w1")][1] is w1[1]


def test_extender_over_the_kubernetes_client_syncs_filters_and_binds(fake, cluster, kube_extender) -> None:  # type: ignore[no-untyped-def]
    ext = kube_extender
    assert ext.state.totals()["nodes"] == 2
    assert ext.api.filter({"Pod": pod("p", mem=[6]), "NodeNames": ["n1", "w1"]})["NodeNames"] == ["n1"]
    first = len(fake.requests)
    assert ext.api.bind(
        {"PodName": "p", "PodNamespace": "default", "PodUID": "uid-default-p", "Node": "n1"}
    ) == {"Error": ""}
    bound = next(p for p in cluster.pods() if p["metadata"]["name"] == "p")
    assert bound["spec"]["nodeName"] == "n1" and "gpufleet.io/assignment" in bound["metadata"]["annotations"]

    writes = [(m, path, kind, body) for m, path, kind, body in fake.requests if m != "GET"]
    assert [(m, path) for m, path, _, _ in writes] == [
        ("PATCH", "/api/v1/nodes/n1"),
        ("PATCH", "/api/v1/namespaces/default/pods/p"),
        ("POST", "/api/v1/namespaces/default/pods/p/binding"),
    ]
    node_patch, pod_patch, binding = (body for _, _, _, body in writes)
    assert writes[0][2] == writes[1][2] == "application/merge-patch+json"
    assert (
        node_patch["metadata"]["resourceVersion"]
        and "gpufleet.io/bind-lock" in node_patch["metadata"]["annotations"]
    )
    assert pod_patch["metadata"]["uid"] == "uid-default-p" and pod_patch["metadata"]["resourceVersion"]
    assert binding["metadata"]["uid"] == "uid-default-p" and binding["target"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": "n1",
    }
    # Those three writes and no read: the pod and the node came from the watch, and the fit was checked
    # against the watch once it showed the pod's assignment (no list of the node's pods: issue 31).
    lists = ("/api/v1/nodes", "/api/v1/pods")  # the watches (re)connecting meanwhile
    calls = [(m, path) for m, path, _, _ in fake.requests[first:] if path not in lists]
    assert calls == [(m, path) for m, path, _, _ in writes]

    # The watch brings the bind back, then the device plugin's unlock.
    eventually(lambda: ext.state.reservation_count() == 0)
    cluster.complete_allocations()
    eventually(lambda: ext.state.inspect_node("n1")["bind_lock"] is None)
    assert sum(g["used_gib"] for g in ext.state.inspect_node("n1")["gpus"]) == 6


def test_nodes_are_listed_and_watched_as_metadata_only(fake, cluster, kube_extender) -> None:  # type: ignore[no-untyped-def]
    """Nodes come as PartialObjectMetadata (names, labels, annotations; no status), with plain JSON as the
    fallback; pods whole. A node change arriving by the watch as metadata still reaches the decisions."""

    def seen() -> dict[tuple[str, bool], str]:
        return {(path.split("?")[0], "watch=true" in path): accept for path, accept in fake.accepts}

    eventually(lambda: len(seen()) == 4)  # the watches start once both lists are in
    accepts = seen()
    assert accepts[("/api/v1/nodes", False)].startswith("application/json;as=PartialObjectMetadataList;")
    assert accepts[("/api/v1/nodes", True)].startswith("application/json;as=PartialObjectMetadata;")
    assert all(a.endswith(",application/json") for (path, _), a in accepts.items() if path == "/api/v1/nodes")
    assert "as=" not in accepts[("/api/v1/pods", False)] + accepts[("/api/v1/pods", True)]
    filter_args = {"Pod": pod("q", mem=[14]), "NodeNames": ["n1", "m9"]}
    assert "m9" in kube_extender.api.filter(filter_args)["FailedNodes"]  # unknown
    cluster.add_node(node("m9", machine("m9", 1, mem=40)))
    eventually(lambda: "m9" not in kube_extender.api.filter(filter_args)["FailedNodes"])
    assert kube_extender.metrics.get("gpufleet_extender_filter_nodes_total", outcome="fit") >= 3  # 1, then 2
    # The stand-in answers as the real server does (checked against the lab's 1.20 API server): whole
    # Nodes to plain JSON, metadata to the metadata Accept.
    source = kube_cluster(fake.url)
    plain = source._request("list", "GET", "/api/v1/nodes", {"limit": 1})
    assert "status" in plain["items"][0]
    doc = source._request("list", "GET", "/api/v1/nodes", {"limit": 1}, accept=NODE_LIST_ACCEPT)
    assert (doc["kind"], doc["apiVersion"]) == ("PartialObjectMetadataList", "meta.k8s.io/v1")
    assert set(doc["items"][0]) == {"kind", "apiVersion", "metadata"}


def test_api_errors_map_to_the_extenders_error_kinds(fake, cluster) -> None:  # type: ignore[no-untyped-def]
    kube = kube_cluster(fake.url)
    with pytest.raises(NotFoundError):
        kube.get_node("ghost")
    version = kube.get_node("n1")["metadata"]["resourceVersion"]
    with pytest.raises(ConflictError):
        kube.patch_node_annotations("n1", {"x": "1"}, str(int(version) - 1))
    with pytest.raises(InvalidError) as invalid:
        kube.patch_pod_annotations("default", "p", "wrong-uid", {"x": "1"})
    assert invalid.value.status == 422
    patched = kube.patch_node_annotations("n1", {"x": "1"}, version)
    assert patched["metadata"]["annotations"]["x"] == "1"
    assert (
        "x"
        not in kube.patch_node_annotations("n1", {"x": None}, patched["metadata"]["resourceVersion"])[
            "metadata"
        ]["annotations"]
    )
    assert not kube.get_pod("default", "p")["spec"].get("nodeName")
    kube.bind_pod("default", "p", "uid-default-p", "n1")
    assert kube.get_pod("default", "p")["spec"]["nodeName"] == "n1"
    with pytest.raises(ConflictError):
        kube.bind_pod("default", "p", "uid-default-p", "n1")


def test_unreachable_api_server_is_unavailable_not_a_crash() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    kube = kube_cluster(f"http://127.0.0.1:{port}")
    with pytest.raises(UnavailableError):
        kube.get_node("n1")


def test_watch_relists_after_the_event_log_was_compacted(fake, cluster, kube_extender) -> None:  # type: ignore[no-untyped-def]
    ext = kube_extender
    fake.compact()  # the next watch reconnect (every second here) gets 410 Gone and must relist
    extra = node("n2", machine("b", 1, mem=24))
    fake.compact()
    cluster.add_node(extra)
    fake.compact()  # the event itself is gone too: only a relist can find n2
    eventually(lambda: ext.state.entry("n2") is not None, timeout=10)
    assert ext.state.watch_error is None or "410" not in ext.state.watch_error


def test_watch_reports_and_recovers_from_an_api_outage(cluster, clock) -> None:  # type: ignore[no-untyped-def]
    cluster.add_node(node("n1", machine("a", 1)))
    server = FakeApiServer(cluster)
    port = server.server.server_address[1]
    ext = Extender(Settings(), kube_cluster(server.url, watch_timeout=1), clock)
    ext.start()
    try:
        assert ext.wait_synced(10)
        server.close()
        eventually(lambda: ext.state.watch_error is not None, timeout=10)
        assert ext.state.inspect()["totals"]["nodes"] == 1  # still answering from the cache
        server = FakeApiServer(cluster, port=port)
        cluster.add_node(node("n2", machine("b", 1)))
        eventually(lambda: ext.state.watch_error is None and ext.state.entry("n2") is not None, timeout=10)
    finally:
        ext.stop()
        server.close()


@pytest.mark.parametrize("install", ["checkout", "base"])
def test_serve_command_runs_against_an_api_server_and_stops_on_sigterm(  # type: ignore[no-untyped-def]
    fake, tmp_path, install, base_install_env
) -> None:
    """Also as gpufleet's base install (no ansible, testinfra, pyVmomi or harness importable)."""
    kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        extender_command(kubeconfig, port),
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(base_install_env if install == "base" else {})},
    )
    try:

        def ready() -> bool:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/readyz")
                return conn.getresponse().status == 200
            except OSError:
                return False

        eventually(ready, timeout=30)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request(
            "POST", "/gpufleet/filter", body=json.dumps({"Pod": pod("p", mem=[6]), "NodeNames": ["n1"]})
        )
        assert json.loads(conn.getresponse().read())["NodeNames"] == ["n1"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stderr.read() if proc.stderr else ""
    assert "event=serving" in log and "event=stopping signal=SIGTERM" in log and "event=stopped" in log
