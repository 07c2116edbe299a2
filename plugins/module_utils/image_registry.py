# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Pushing an image archive to a registry over the OCI distribution API (standard library only).

What is used of the API: ``GET /v2/`` (is it there, which authentication), ``HEAD`` of a blob or manifest
(already there: nothing sent), a monolithic blob upload (``POST /v2/<name>/blobs/uploads/``, then ``PUT
<location>?digest=``) and ``PUT /v2/<name>/manifests/<tag>``. Authentication: none, HTTP basic, or the bearer
token a ``WWW-Authenticate: Bearer realm=...`` challenge asks for (fetched from the realm with the basic
credentials), as registries hand them out. Credentials never appear in messages.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import ssl
import tarfile
import urllib.parse
from typing import Any

from .ociarchive import ArchiveImage, blob_path

TIMEOUT = 30


class RegistryError(Exception):
    """The registry cannot be reached, refuses the credentials, or answers what the API does not."""


def split_registry(registry: str) -> tuple[str, str]:
    """``host[:port][/path]`` → (``host[:port]``, ``path`` without slashes)."""
    host, _sep, path = registry.strip().removeprefix("https://").removeprefix("http://").partition("/")
    if not host:
        raise RegistryError(f"registry {registry!r}: expected host[:port][/path]")
    return host, path.strip("/")


class Registry:
    """A registry at ``host[:port]`` (``scheme`` https or http)."""

    def __init__(
        self,
        host: str,
        *,
        scheme: str = "https",
        username: str = "",
        password: str = "",
        ca_file: str | None = None,
        validate_certs: bool = True,
    ) -> None:
        self.host, self.scheme = host, scheme
        self._basic = (
            ("Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()) if username else ""
        )
        self._token = ""
        self._context: ssl.SSLContext | None = None
        if scheme == "https":
            self._context = ssl.create_default_context(cafile=ca_file or None)
            if not validate_certs:
                self._context.check_hostname = False
                self._context.verify_mode = ssl.CERT_NONE

    # -- transport -------------------------------------------------------------------------------------------
    def _connection(self, netloc: str, scheme: str) -> http.client.HTTPConnection:
        if scheme == "https":
            return http.client.HTTPSConnection(netloc, timeout=TIMEOUT, context=self._context)
        return http.client.HTTPConnection(netloc, timeout=TIMEOUT)

    def _send(
        self, method: str, url: str, body: Any = None, headers: dict[str, str] | None = None, auth: str = ""
    ) -> tuple[int, dict[str, str], bytes]:
        parts = urllib.parse.urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        conn = self._connection(parts.netloc, parts.scheme)
        try:
            conn.request(
                method,
                target,
                body=body,
                headers={**(headers or {}), **({"Authorization": auth} if auth else {})},
            )
            response = conn.getresponse()
            data = response.read()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, data
        except (OSError, http.client.HTTPException) as exc:
            raise RegistryError(f"cannot reach the registry at {self.scheme}://{self.host}: {exc}") from None
        finally:
            conn.close()

    def _bearer(self, challenge: str) -> str:
        fields = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = fields.pop("realm", "")
        if not realm:
            raise RegistryError(f"registry {self.host}: a bearer challenge without a realm")
        url = realm + "?" + urllib.parse.urlencode(fields)
        status, _head, data = self._send("GET", url, auth=self._basic)
        if status != 200:
            raise RegistryError(f"registry {self.host}: the token service {realm} answered {status}")
        doc = json.loads(data or b"{}")
        token = doc.get("token") or doc.get("access_token")
        if not token:
            raise RegistryError(f"registry {self.host}: the token service {realm} gave no token")
        return f"Bearer {token}"

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """One API call, authenticating once when the registry asks for it."""
        url = path if "://" in path else f"{self.scheme}://{self.host}{path}"
        status, head, data = self._send(method, url, body, headers, self._token or self._basic)
        if status == 401:
            challenge = head.get("www-authenticate", "")
            if challenge.lower().startswith("bearer"):
                self._token = self._bearer(challenge)
            elif not self._basic:
                raise RegistryError(
                    f"registry {self.host} wants credentials (gpufleet_images_registry_username)"
                )
            if hasattr(body, "seek"):
                body.seek(0)
            status, head, data = self._send(method, url, body, headers, self._token or self._basic)
            if status == 401:
                raise RegistryError(f"registry {self.host} refused the credentials (401)")
        return status, head, data

    # -- the API ---------------------------------------------------------------------------------------------
    def ping(self) -> None:
        """Raise RegistryError unless ``/v2/`` answers as a registry does."""
        status, _head, data = self.request("GET", "/v2/")
        if status != 200:
            raise RegistryError(f"registry {self.host}: GET /v2/ answered {status}: {data[:200]!r}")

    def has(self, repository: str, kind: str, digest: str) -> bool:
        status, _head, _data = self.request(
            "HEAD",
            f"/v2/{repository}/{kind}/{digest}",
            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
        )
        return status == 200

    def upload_blob(self, repository: str, digest: str, body: Any, size: int) -> None:
        status, head, data = self.request(
            "POST", f"/v2/{repository}/blobs/uploads/", b"", {"Content-Length": "0"}
        )
        location = head.get("location", "")
        if status != 202 or not location:
            raise RegistryError(
                f"registry {self.host}: starting an upload to {repository} answered {status}: {data[:200]!r}"
            )
        if location.startswith("/"):
            location = f"{self.scheme}://{self.host}{location}"
        location += ("&" if "?" in location else "?") + urllib.parse.urlencode({"digest": digest})
        status, _head, data = self.request(
            "PUT", location, body, {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        )
        if status != 201:
            raise RegistryError(
                f"registry {self.host}: uploading {digest} to {repository} answered {status}: {data[:200]!r}"
            )

    def put_manifest(self, repository: str, reference: str, media_type: str, manifest: bytes) -> None:
        status, _head, data = self.request(
            "PUT", f"/v2/{repository}/manifests/{reference}", manifest, {"Content-Type": media_type}
        )
        if status != 201:
            raise RegistryError(
                f"registry {self.host}: storing the manifest of {repository}:{reference} "
                f"answered {status}: {data[:200]!r}"
            )


def push(
    registry: Registry, repository: str, tag: str, image: ArchiveImage, check_mode: bool = False
) -> bool:
    """Push ``image`` as ``repository:tag``; False when the registry has its manifest already."""
    if registry.has(repository, "manifests", image.digest):
        return False
    if check_mode:
        return True
    blobs = [
        (image.image_id, len(image.config_bytes)),
        *((layer["digest"], layer["size"]) for layer in image.layers),
    ]
    with tarfile.open(image.path) as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers()}
        for digest, size in blobs:
            if registry.has(repository, "blobs", digest):
                continue
            handle = tar.extractfile(members[blob_path(digest)])
            registry.upload_blob(repository, digest, handle, size)
    media_type = image.manifest.get("mediaType") or "application/vnd.oci.image.manifest.v1+json"
    registry.put_manifest(repository, tag, media_type, image.manifest_bytes)
    return True
