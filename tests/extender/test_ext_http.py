"""The server on an ephemeral loopback port: verbs, keep-alive, read-only endpoints, bad input, HTTPS."""

from __future__ import annotations

import http.client
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from extender_builders import connect, load_fixture, request, serve

from gpufleet.extender.settings import Settings


def test_scheduler_verbs_over_one_keep_alive_connection(server) -> None:  # type: ignore[no-untyped-def]
    conn = connect(server)
    status, result = request(conn, "POST", "/gpufleet/filter", load_fixture("filter_nodenames.json"))
    assert status == 200 and result["NodeNames"] == ["mixed-0"]  # of three that fit: the one it places on
    status, scores = request(conn, "POST", "/gpufleet/prioritize", load_fixture("filter_nodenames.json"))
    assert status == 200 and {s["Host"] for s in scores} >= {"dgx-a100-0"}
    status, result = request(conn, "POST", "/gpufleet/bind", load_fixture("bind.json"))
    assert (status, result) == (200, {"Error": ""})
    conn.close()


def test_full_nodes_mode_over_http(server) -> None:  # type: ignore[no-untyped-def]
    status, result = request(connect(server), "POST", "/gpufleet/filter", load_fixture("filter_nodes.json"))
    assert status == 200 and len(result["Nodes"]["items"]) == 1 and result["NodeNames"] is None


def test_read_only_endpoints(server) -> None:  # type: ignore[no-untyped-def]
    conn = connect(server)
    assert request(conn, "GET", "/healthz") == (200, {"status": "ok"})
    assert request(conn, "GET", "/gpufleet/readyz")[1]["ready"] is True
    status, version = request(conn, "GET", "/version")
    assert status == 200 and version["component"] == "gpufleet-extender"
    status, inspect = request(conn, "GET", "/gpufleet/inspect")
    assert status == 200 and inspect["synced"] and inspect["totals"]["nodes"] == 6
    status, one = request(conn, "GET", "/gpufleet/inspect/dgx-a100-0")
    assert (
        status == 200
        and one["gpus"][0]["used_gib"] == 60
        and one["gpus"][0]["pods"][0]["pod"] == "ml/train-7f9c"
    )
    assert request(conn, "GET", "/gpufleet/inspect/ghost")[0] == 404
    request(conn, "POST", "/gpufleet/filter", load_fixture("filter_nodenames.json"))
    status, text = request(conn, "GET", "/metrics")
    assert status == 200
    assert 'gpufleet_extender_requests_total{code="200",verb="filter"} 1' in text
    assert 'gpufleet_extender_gpu_memory_gib{state="total"}' in text
    assert "# TYPE gpufleet_extender_request_seconds histogram" in text


def test_readyz_is_unavailable_until_synced(server, world) -> None:  # type: ignore[no-untyped-def]
    world.state.watch.listed.clear()
    status, body = request(connect(server), "GET", "/readyz")
    assert status == 503 and body["ready"] is False


@pytest.mark.parametrize(
    ("path", "raw", "status", "message"),
    [
        ("/gpufleet/filter", b"{not json", 400, "not JSON"),
        ("/gpufleet/filter", b'{"NodeNames": []}', 400, "Pod"),
        ("/gpufleet/prioritize", b"[1, 2]", 400, "JSON object"),
        ("/gpufleet/bind", b'{"PodName": "x"}', 400, "Node"),
        ("/gpufleet/bind", b"\xff\xfe", 400, "not JSON"),
        ("/gpufleet/preempt", b"{}", 404, "no verb"),
    ],
)
def test_bad_requests_get_an_error_and_the_server_keeps_serving(server, path, raw, status, message) -> None:  # type: ignore[no-untyped-def]
    conn = connect(server)
    got, body = request(conn, "POST", path, raw=raw)
    assert got == status and message in body["Error"]
    # Same connection, next request works.
    assert request(conn, "GET", "/healthz")[0] == 200


def test_missing_length_and_oversized_bodies_are_refused(world) -> None:  # type: ignore[no-untyped-def]
    srv = serve(world, Settings(listen_address="127.0.0.1", port=0, url_prefix="/", max_body_mib=1))
    try:
        conn = connect(srv)
        conn.putrequest("POST", "/filter")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        conn.send(b"0\r\n\r\n")
        response = conn.getresponse()
        assert response.status == 411
        response.read()
        conn.close()
        conn = connect(srv)
        conn.putrequest("POST", "/filter")
        conn.putheader("Content-Length", str(1024 * 1024 + 1))  # announced, never sent
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 413
        response.read()
        assert request(connect(srv), "GET", "/healthz")[0] == 200
    finally:
        srv.shutdown()
        srv.server_close()


def test_an_internal_error_is_a_500_not_a_crash(server, world, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def boom(args: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(world.api, "filter", boom)
    conn = connect(server)
    status, body = request(conn, "POST", "/gpufleet/filter", {"Pod": {}})
    assert status == 500 and "boom" in body["Error"]
    assert request(conn, "GET", "/healthz")[0] == 200


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    d = tmp_path_factory.mktemp("pki")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=gpufleet-test-ca",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, ext in (("server", ["-extfile", "san.ext"]), ("client", [])):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=gpufleet-{name}",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            *ext,
            cwd=d,
        )
    return d


def test_https_with_client_ca_requires_a_signed_client_certificate(world, pki, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With a client CA, every verb and read-only endpoint needs a client certificate signed by it; only the
    probes' /healthz and /readyz answer without one (the kubelet's HTTPS probes present none). A certificate
    from another CA fails the handshake."""
    settings = Settings(
        listen_address="127.0.0.1",
        port=0,
        url_prefix="/gpufleet",
        tls_cert_file=str(pki / "server.crt"),
        tls_key_file=str(pki / "server.key"),
        tls_client_ca_file=str(pki / "ca.crt"),
    )
    srv = serve(world, settings)
    port = srv.server_address[1]
    assert srv.url == f"https://127.0.0.1:{port}/gpufleet"
    try:
        trusting = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        for path in ("/healthz", "/readyz", "/gpufleet/readyz"):
            anonymous = http.client.HTTPSConnection("127.0.0.1", port, context=trusting, timeout=10)
            assert request(anonymous, "GET", path)[0] == 200, path
        for method, path, body in (("POST", "/gpufleet/filter", load_fixture("filter_nodenames.json")),
                                   ("GET", "/metrics", None), ("GET", "/gpufleet/inspect", None),
                                   ("GET", "/version", None)):  # fmt: skip
            anonymous = http.client.HTTPSConnection("127.0.0.1", port, context=trusting, timeout=10)
            status, said = request(anonymous, method, path, body)
            assert status == 401 and "client certificate" in said["Error"], (path, status, said)
        # a certificate the client CA did not sign: refused in the handshake
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out", "other.crt",
                 "-days", "2", "-subj", "/CN=someone-else", cwd=tmp_path)  # fmt: skip
        foreign = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        foreign.load_cert_chain(str(tmp_path / "other.crt"), str(tmp_path / "other.key"))
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            request(
                http.client.HTTPSConnection("127.0.0.1", port, context=foreign, timeout=10), "GET", "/version"
            )
        trusting.load_cert_chain(str(pki / "client.crt"), str(pki / "client.key"))
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=trusting, timeout=10)
        status, result = request(conn, "POST", "/gpufleet/filter", load_fixture("filter_nodenames.json"))
        assert status == 200 and result["NodeNames"] == ["mixed-0"]
        # The refused clients did not take the server down.
        assert request(conn, "GET", "/healthz")[0] == 200
        assert request(conn, "GET", "/version")[0] == 200
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_burst_of_new_connections_waits_in_the_listen_backlog(world: Any) -> None:
    """While the accept loop is busy (here: not running), new connections queue in the kernel's backlog.
    socketserver's default of 5 would make the kernel drop the sixth client's SYN, which it retries only
    after a second; 40 at once must all be queued."""
    from gpufleet.extender.server import make_server

    srv = make_server(world, Settings(listen_address="127.0.0.1", port=0, url_prefix="/gpufleet"))
    clients = []
    serving = threading.Thread(target=srv.serve_forever, daemon=True)
    try:
        for _ in range(40):
            clients.append(socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=5))
        serving.start()
        for sock in clients:  # each queued connection is then served
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert sock.recv(64).startswith(b"HTTP/1.1 200"), "a queued connection was not served"
    finally:
        for sock in clients:
            sock.close()
        if serving.is_alive():
            srv.shutdown()
        srv.server_close()
