"""TLS for the gRPC transport: credentials from COMMSCHED_GRPC_TLS_*, a throwaway CA for local jobs,
and telling a peer that speaks TLS from one that does not, so a mismatch gets a clear error."""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The variables commsched-run --grpc-tls sets; commsched.config reads and checks them.
CA_VARIABLE = "COMMSCHED_GRPC_TLS_CA"
CERT_VARIABLE = "COMMSCHED_GRPC_TLS_CERT"
KEY_VARIABLE = "COMMSCHED_GRPC_TLS_KEY"
SERVER_NAME_VARIABLE = "COMMSCHED_GRPC_TLS_SERVER_NAME"
_VALID_DAYS = 7  # a throwaway certificate outlives its job, not much more
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@dataclass(frozen=True)
class TlsFiles:
    """The PEM bytes of one rank's TLS identity and the CA its peers must chain to."""

    ca: bytes
    cert: bytes
    key: bytes
    server_name: str = ""  # checked against the peers' certificates instead of the address dialled

    @classmethod
    def from_settings(cls, settings: Any) -> TlsFiles | None:
        """The files COMMSCHED_GRPC_TLS_CA/CERT/KEY name (checked by commsched.config), or None without TLS."""
        if not settings.grpc_tls_ca:
            return None
        return cls(
            Path(settings.grpc_tls_ca).read_bytes(),
            Path(settings.grpc_tls_cert).read_bytes(),
            Path(settings.grpc_tls_key).read_bytes(),
            settings.grpc_tls_server_name,
        )

    def server_credentials(self) -> Any:
        """Server side: presents the rank's certificate and requires a client certificate from the CA."""
        import grpc

        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> Any:
        """Client side: checks the server against the CA and presents the rank's certificate."""
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        """gRPC channel options: the name the server certificates carry, when one is set."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def speaks_tls(host: str, port: int, timeout_s: float = 2.0) -> bool | None:
    """True if the server at host:port answers plaintext HTTP/2 like a TLS server, False if it speaks
    plaintext HTTP/2, None if it cannot be told (no answer)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as probe:
            probe.sendall(
                _HTTP2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
            )  # preface + empty SETTINGS
            answer = probe.recv(16)
    except OSError:
        return None
    if len(answer) >= 4 and answer[3] == 0x04:  # an HTTP/2 frame header of type SETTINGS
        return False
    if answer[:1] in (b"\x15", b"\x16"):  # a TLS alert or handshake record
        return True
    return True if not answer else None  # a TLS server drops a plaintext client without a word


def make_job_certificates(directory: str, hosts: list[str]) -> dict[str, str]:
    """A throwaway CA and one certificate for this host's ranks in `directory`; returns the
    COMMSCHED_GRPC_TLS_* variables that point at them. Uses the `cryptography` package when it is
    installed, else the openssl command."""
    names = sorted({"localhost", socket.gethostname(), *hosts} - {""})
    addresses = sorted({"127.0.0.1", "::1"} | {h for h in hosts if _is_address(h)})
    names = [n for n in names if not _is_address(n)]
    folder = Path(directory)
    folder.chmod(0o700)
    try:
        import cryptography  # noqa: F401
    except ImportError:
        _make_with_openssl(folder, names, addresses)
    else:
        _make_with_cryptography(folder, names, addresses)
    (folder / "rank.key").chmod(0o600)
    return {
        CA_VARIABLE: str(folder / "ca.pem"),
        CERT_VARIABLE: str(folder / "rank.pem"),
        KEY_VARIABLE: str(folder / "rank.key"),
    }


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _make_with_cryptography(folder: Path, names: list[str], addresses: list[str]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "commsched job CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alternative = [x509.DNSName(n) for n in names] + [
        x509.IPAddress(ipaddress.ip_address(a)) for a in addresses
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "commsched rank")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(alternative), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "rank.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file = folder / "rank.key"
    key_file.touch(mode=0o600)
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def _make_with_openssl(folder: Path, names: list[str], addresses: list[str]) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError(
            "commsched-run --grpc-tls needs the `cryptography` package (pip install cryptography) or the openssl "
            "command to make the job's certificates; or give your own with COMMSCHED_GRPC_TLS_CA/CERT/KEY"
        )
    alternative = ",".join([f"DNS:{n}" for n in names] + [f"IP:{a}" for a in addresses])
    (folder / "rank.ext").write_text(
        f"subjectAltName={alternative}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"
    )
    days = str(_VALID_DAYS)
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*arguments: str) -> None:
        done = subprocess.run([openssl, *arguments], cwd=folder, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"openssl {arguments[0]} failed making the job's certificates: {done.stderr.strip()}"
            )

    old_umask = os.umask(0o077)  # the keys are readable by this user only from the start
    try:
        run(
            "req",
            "-x509",
            *curve,
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            days,
            "-subj",
            "/CN=commsched job CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE,pathlen:0",
        )
        run("req", *curve, "-keyout", "rank.key", "-out", "rank.csr", "-subj", "/CN=commsched rank")
        run(
            "x509",
            "-req",
            "-in",
            "rank.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "rank.pem",
            "-days",
            days,
            "-extfile",
            "rank.ext",
        )
    finally:
        os.umask(old_umask)
    for leftover in ("ca.key", "rank.csr", "rank.ext", "ca.srl"):
        (folder / leftover).unlink(missing_ok=True)  # the CA key signs nothing more: gone with the job
