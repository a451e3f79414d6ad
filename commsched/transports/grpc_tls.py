"""TLS for the gRPC transport: credentials from COMMSCHED_GRPC_TLS_*, a throwaway CA for local jobs,
telling a peer that speaks TLS from one that does not, and why a TLS handshake fails (this rank's own
certificate checked at start, a peer's refusal found by a handshake of its own), so a mismatch or a
bad certificate gets a clear error instead of a timeout."""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
from collections.abc import Callable
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
    ca_path: str = ""  # where they came from, for messages
    cert_path: str = ""

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
            settings.grpc_tls_ca,
            settings.grpc_tls_cert,
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

    def ssl_contexts(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        """(server, client) Python contexts with this CA and certificate, each requiring the other's;
        the client checks the host name."""
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        server.verify_mode = ssl.CERT_REQUIRED
        # load_cert_chain reads files only: the PEM bytes pass through a private directory, gone at once.
        with tempfile.TemporaryDirectory(prefix="commsched-tls-") as folder:
            cert, key = Path(folder) / "rank.pem", Path(folder) / "rank.key"
            key.touch(mode=0o600)
            key.write_bytes(self.key)
            cert.write_bytes(self.cert)
            for context in (server, client):
                context.minimum_version = ssl.TLSVersion.TLSv1_2
                context.load_verify_locations(cadata=self.ca.decode())
                context.load_cert_chain(str(cert), str(key))
        return server, client

    def named(self, variable: str) -> str:
        """`variable`, with the file it names where known."""
        path = {CA_VARIABLE: self.ca_path, CERT_VARIABLE: self.cert_path}.get(variable, "")
        return f"{variable}={path}" if path else variable

    def own_certificate_problem(self) -> str:
        """Why a peer would refuse this rank's certificate, found by a TLS handshake of this rank with
        itself in memory (the certificate shown as server and as client, checked against the CA as
        every peer checks it); "" if none. Expired, not yet valid, signed by another CA, or a key that
        does not belong to it: every peer would refuse it, so the rank says so at start."""
        try:
            server_context, client_context = self.ssl_contexts()
        except ssl.SSLError as error:
            return (
                f"{self.named(CERT_VARIABLE)} and {KEY_VARIABLE} cannot be used together ({_reason(error)}): "
                "the key must be the certificate's"
            )
        client_context.check_hostname = False  # the name is checked against each address dialled
        bios = [ssl.MemoryBIO() for _ in range(4)]
        server = server_context.wrap_bio(bios[0], bios[1], server_side=True)
        client = client_context.wrap_bio(bios[2], bios[3], server_side=False)
        sides = [(client, bios[3], bios[0]), (server, bios[1], bios[2])]
        done = [False, False]
        for _ in range(16):
            for index, (side, outgoing, peer_incoming) in enumerate(sides):
                if not done[index]:
                    try:
                        side.do_handshake()
                        done[index] = True
                    except ssl.SSLWantReadError:
                        pass
                    except ssl.SSLError as error:
                        return (
                            f"this rank's certificate ({self.named(CERT_VARIABLE)}) does not verify against "
                            f"{self.named(CA_VARIABLE)}: {_reason(error)}{_validity(self.cert)}; every peer would "
                            "refuse it in the TLS handshake"
                        )
                peer_incoming.write(outgoing.read())
            if all(done):
                return ""
        return ""  # no verdict: the peers' handshakes will tell


def check_own_certificate(tls: TlsFiles, rank: int, tell: Callable[[str], object] | None = None) -> None:
    """Raises ValueError naming the setting when `tls` holds a certificate every peer would refuse;
    `tell` hears the reason first (a joining rank passes it on to rank 0)."""
    problem = tls.own_certificate_problem()
    if problem:
        if tell is not None:
            tell(problem)
        raise ValueError(
            f"rank {rank}: {problem}. Give every rank a valid certificate signed by the job's CA in "
            f"{CERT_VARIABLE}, its key in {KEY_VARIABLE} and that CA in {CA_VARIABLE} "
            "(commsched-run --grpc-tls makes a fresh set for a local job)"
        )


def handshake_refusal(address: str, tls: TlsFiles, peer: str, timeout_s: float = 2.0) -> str:
    """Why a TLS handshake between this rank and the gRPC server at host:port fails, tried with
    Python's ssl and this rank's TLS files as gRPC uses them; "" if it succeeds or cannot be tried.

    This rank refusing the peer's certificate shows as a verification error; the peer refusing this
    rank's shows, with a gRPC server, as the connection closed right after the handshake.
    """
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return ""
    host = host.strip("[]")
    try:
        _, context = tls.ssl_contexts()
    except ssl.SSLError:
        return ""  # check_own_certificate names it
    context.set_alpn_protocols(["h2"])  # as gRPC: a server that negotiates no HTTP/2 closes at once
    name = tls.server_name or host
    try:
        with (
            socket.create_connection((host, int(port)), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=name) as secure,
        ):
            secure.settimeout(timeout_s)
            try:
                answer = secure.recv(16)
            except TimeoutError:
                return ""  # taken, and quiet: not a refusal
            except ssl.SSLError as error:  # an alert on this rank's certificate
                return (
                    f"{peer} at {address} refused this rank's certificate ({tls.named(CERT_VARIABLE)}) in the "
                    f"TLS handshake: {_reason(error)}{_validity(tls.cert)}; it must verify against {peer}'s "
                    f"{CA_VARIABLE}"
                )
    except ssl.SSLCertVerificationError as error:
        if "hostname" in _reason(error).lower() or "ip address mismatch" in _reason(error).lower():
            return (
                f"this rank does not accept the certificate of {peer} at {address}: {_reason(error)} (the name "
                f"checked is {name!r}); give the certificates that name, or set {SERVER_NAME_VARIABLE} to the name "
                "they carry"
            )
        return (
            f"this rank does not accept the certificate of {peer} at {address}: {_reason(error)}; it must be "
            f"valid and signed by the CA in this rank's {tls.named(CA_VARIABLE)} (check {CERT_VARIABLE} on {peer})"
        )
    except ssl.SSLError as error:
        return f"the TLS handshake with {peer} at {address} failed: {_reason(error)}; check {CA_VARIABLE}, {CERT_VARIABLE} and {KEY_VARIABLE} on both"
    except OSError:
        return ""  # not there (yet): no TLS verdict
    if answer:
        return ""
    return (
        f"{peer} at {address} closed the connection right after the TLS handshake: it refused this rank's "
        f"certificate ({tls.named(CERT_VARIABLE)}{_validity(tls.cert)}), which must verify against {peer}'s "
        f"{CA_VARIABLE} (signed by the same CA, and not expired); {peer}'s own error names the reason"
    )


def _reason(error: ssl.SSLError) -> str:
    """OpenSSL's words for a failed handshake, without Python's source location."""
    text = getattr(error, "verify_message", "") or ""
    if text:
        return f"certificate verify failed: {text}"
    text = str(error.args[1]) if len(error.args) > 1 else str(error)
    return text.split(" (_ssl.c:")[0]


def _validity(cert_pem: bytes) -> str:
    """ " (valid from ... until ...)" for the first certificate in `cert_pem`, or "" without `cryptography`."""
    try:
        from cryptography import x509
    except ImportError:
        return ""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    except (ValueError, AttributeError):
        return ""
    return f" (valid from {start:%Y-%m-%d %H:%M} until {end:%Y-%m-%d %H:%M} UTC)"


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
