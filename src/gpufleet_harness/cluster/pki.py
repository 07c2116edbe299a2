"""Keys and certificates for one test cluster, made with the ``openssl`` command (ECDSA P-256: fast to
generate).

The cluster CA signs client certificates: one per kubelet node (``CN=system:node:<name>, O=system:nodes``,
what the Node authorizer expects) and one the apiserver presents to kubelets. The apiserver's own
serving certificate is the self-signed one it writes into ``--cert-dir``, unless the cluster needs it to name
more addresses (kubelets in containers dial it through a gateway): then the CA signs one
(:func:`serving_certificate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet_harness.cluster.process import run

_CURVE = "ec_paramgen_curve:prime256v1"
_DAYS = "30"


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its private key."""

    cert: Path
    key: Path


def _new_key(path: Path) -> None:
    run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", _CURVE, "-out", path])
    path.chmod(0o600)


def service_account_keys(directory: Path) -> tuple[Path, Path]:
    """Private and public key that sign and verify service-account tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    private, public = directory / "sa.key", directory / "sa.pub"
    _new_key(private)
    run(["openssl", "pkey", "-in", private, "-pubout", "-out", public])
    return private, public


def certificate_authority(directory: Path, name: str = "gpufleet-lab-ca") -> KeyPair:
    """A self-signed CA for the cluster's client certificates."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = KeyPair(directory / "ca.crt", directory / "ca.key")
    _new_key(ca.key)
    run(["openssl", "req", "-x509", "-new", "-key", ca.key, "-subj", f"/CN={name}", "-days", _DAYS,
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
         "-out", ca.cert])  # fmt: skip
    return ca


def client_certificate(ca: KeyPair, directory: Path, stem: str, common_name: str, *groups: str) -> KeyPair:
    """A client certificate signed by ``ca``: Kubernetes takes the user from CN and groups from O."""
    directory.mkdir(parents=True, exist_ok=True)
    pair = KeyPair(directory / f"{stem}.crt", directory / f"{stem}.key")
    csr = directory / f"{stem}.csr"
    _new_key(pair.key)
    subject = "".join(f"/O={g}" for g in groups) + f"/CN={common_name}"
    run(["openssl", "req", "-new", "-key", pair.key, "-subj", subject, "-out", csr])
    extensions = directory / f"{stem}.ext"
    extensions.write_text("keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n")
    run(["openssl", "x509", "-req", "-in", csr, "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial",
         "-days", _DAYS, "-extfile", extensions, "-out", pair.cert])  # fmt: skip
    csr.unlink()
    extensions.unlink()
    return pair


def serving_certificate(
    ca: KeyPair, directory: Path, stem: str, common_name: str, ips: Sequence[str], names: Sequence[str] = ()
) -> KeyPair:
    """A TLS server certificate signed by ``ca`` for the given IP addresses and DNS names."""
    directory.mkdir(parents=True, exist_ok=True)
    pair = KeyPair(directory / f"{stem}.crt", directory / f"{stem}.key")
    csr = directory / f"{stem}.csr"
    _new_key(pair.key)
    run(["openssl", "req", "-new", "-key", pair.key, "-subj", f"/CN={common_name}", "-out", csr])
    alt = ",".join([*(f"IP:{ip}" for ip in ips), *(f"DNS:{name}" for name in names)])
    extensions = directory / f"{stem}.ext"
    extensions.write_text(
        f"keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName={alt}\n"
    )
    run(["openssl", "x509", "-req", "-in", csr, "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial",
         "-days", _DAYS, "-extfile", extensions, "-out", pair.cert])  # fmt: skip
    csr.unlink()
    extensions.unlink()
    return pair
