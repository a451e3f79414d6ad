"""gRPC over TLS: certificates checked both ways against the job's CA, a clear error when one side
uses TLS and the other does not, the COMMSCHED_GRPC_TLS_* checks, commsched-run --grpc-tls, and the
rate-limited log of refused connections."""

from __future__ import annotations

import importlib
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

import numpy as np
from mpirun import local_launch  # tests/ is on sys.path (conftest.py)
from test_grpc import ROOT, TOKEN, allreduce_pair, job_environment, make_pair, wait_all

from commsched.run import free_port
from commsched.transports import grpc_tls
from commsched.transports import grpc_wire as wire
from commsched.transports.grpc_net import endpoint_from
from commsched.transports.grpc_tls import TlsFiles, make_job_certificates
from commsched.transports.grpc_transport import JOIN_METHOD, GrpcError, GrpcTransport

# `commsched.config` the attribute is the config() function; the module is reached by import.
config = importlib.import_module("commsched.config")


def _tls(directory: Path) -> TlsFiles:
    directory.mkdir(exist_ok=True)
    files = make_job_certificates(str(directory), ["127.0.0.1"])
    settings = config.resolve({}, environ=files)
    tls = TlsFiles.from_settings(settings)
    assert tls is not None
    return tls


def test_tls_pair_reduces_and_refuses_plaintext_and_foreign_certificates(tmp_path: Path) -> None:
    """Two TLS ranks allreduce; a plaintext client and a client of another CA cannot even call Join."""
    tls = _tls(tmp_path / "job")
    pair = make_pair(tls=tls)
    try:
        assert allreduce_pair(pair) == ["", ""]
        address = pair[0].addresses[0]
        foreign = _tls(tmp_path / "other")
        request = wire.JoinRequest(rank=1, size=2, address="127.0.0.1:1")
        metadata = [("commsched-token", TOKEN), ("commsched-rank", "1")]
        for channel in (
            grpc.insecure_channel(address),
            grpc.secure_channel(address, foreign.channel_credentials()),
            # the right CA, but no client certificate: the server asks for one
            grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls.ca)),
        ):
            join = channel.unary_unary(
                JOIN_METHOD,
                request_serializer=wire.JoinRequest.SerializeToString,
                response_deserializer=wire.JoinReply.FromString,
            )
            with pytest.raises(grpc.RpcError) as refused:
                join(request, timeout=3, metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            channel.close()
        assert allreduce_pair(pair) == ["", ""]  # the job goes on
    finally:
        for transport in pair:
            transport.close()


def test_tls_pair_carries_bulk_data_over_tls_only(tmp_path: Path) -> None:
    """With TLS configured, the bulk sockets are TLS sockets (mutually verified at connect time) and
    the large pieces of a checked allreduce and broadcast travel over them."""
    pair = make_pair(tls=_tls(tmp_path / "job"), piece_bytes=256 * 1024)
    try:
        count = 1_000_003
        arrays = [np.arange(count, dtype=np.float64) * (r + 1) for r in range(2)]
        ops = [t.start(a.ctypes.data, count, "float64", "allreduce", 0) for t, a in zip(pair, arrays)]
        assert wait_all(ops, 30) == ["", ""]
        for array in arrays:
            np.testing.assert_array_equal(array, np.arange(count, dtype=np.float64) * 3)
        values = [np.full(count, r + 1, np.int32) for r in range(2)]
        ops = [t.start(v.ctypes.data, count, "int32", "broadcast", 1) for t, v in zip(pair, values)]
        assert wait_all(ops, 30) == ["", ""]
        assert all((v == 2).all() for v in values)
        for transport in pair:
            link = transport._node.bulk
            assert isinstance(link._outgoing, ssl.SSLSocket) and isinstance(link._incoming, ssl.SSLSocket)
            assert link._incoming.getpeercert() is not None  # the peer showed a certificate of the CA
            stats = transport.bulk_stats()
            assert stats["tls"] is True and stats["sent_bytes"] >= 8 * count, stats
    finally:
        for transport in pair:
            transport.close()


@pytest.mark.parametrize("tls_rank", [0, 1])
def test_tls_on_one_side_only_is_named(tmp_path: Path, tls_rank: int) -> None:
    """Rank 1 joining rank 0 with TLS on one side only fails at once, saying which side uses TLS."""
    tls = _tls(tmp_path / "job")
    port = free_port()
    errors: list[Any] = [None, None]
    made: list[Any] = [None, None]

    def build(rank: int) -> None:
        endpoint = endpoint_from(rank, 2, "127.0.0.1", port, [], "", False)
        try:
            made[rank] = GrpcTransport(
                endpoint, TOKEN, timeout_s=1.0, join_timeout_s=4.0, tls=tls if rank == tls_rank else None
            )
        except GrpcError as error:
            errors[rank] = error

    threads = [threading.Thread(target=build, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    threads[1].join(20)
    assert not threads[1].is_alive()
    text = str(errors[1])
    if tls_rank == 0:
        assert "rank 1 does not use TLS, but the rank at 127.0.0.1:" in text, text
    else:
        assert "rank 1 uses TLS (COMMSCHED_GRPC_TLS_*), but the rank at 127.0.0.1:" in text, text
    assert "COMMSCHED_GRPC_TLS_CA" in text and "on every rank, or on none" in text, text
    threads[0].join(20)  # rank 0 gives up once its join window is over
    assert made == [None, None] and errors[0] is not None
    assert "COMMSCHED_GRPC_TLS_*" in str(errors[0]), errors[0]


def _authority(days: tuple[int, int] = (-30, 30)) -> tuple[Any, Any]:
    """A CA certificate and its key, valid from days[0] to days[1] from now."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    # Each its own name: OpenSSL finds a certificate's issuer among the trusted ones by name.
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"test CA {x509.random_serial_number()}")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + datetime.timedelta(days=days[0]))
        .not_valid_after(now + datetime.timedelta(days=days[1]))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    return ca, key


def _rank_files(authority: tuple[Any, Any], *trusted: Any, expired: bool = False) -> TlsFiles:
    """A rank's TLS files: a certificate for 127.0.0.1 from `authority` (expired yesterday, if asked)
    and, as its CA file, the authorities in `trusted` (the issuer's alone by default)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca, ca_key = authority
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "a test rank")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=10))
        .not_valid_after(now + datetime.timedelta(days=-1 if expired else 1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return TlsFiles(
        b"".join(c.public_bytes(pem) for c in (trusted or (ca,))),
        cert.public_bytes(pem),
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        ca_path="ca.pem",
        cert_path="rank.pem",
    )


def _names_another_ca(error: str) -> bool:
    """OpenSSL's reason for a chain that ends at a CA the verifier does not trust (the peer may send
    that CA along with its certificate)."""
    return (
        "unable to get local issuer certificate" in error
        or "self-signed certificate in certificate chain" in error
    )


def _join_pair(files: list[TlsFiles], join_timeout_s: float = 8.0) -> list[tuple[float, str]]:
    """Ranks 0, 1, ... with these TLS files try to meet; per rank, seconds until it gave up and its error."""
    port = free_port()
    size = len(files)
    outcome: list[Any] = [None] * size

    def build(rank: int) -> None:
        endpoint = endpoint_from(rank, size, "127.0.0.1", port, [], "", False)
        started = time.monotonic()
        try:
            GrpcTransport(
                endpoint, TOKEN, timeout_s=1.0, join_timeout_s=join_timeout_s, tls=files[rank]
            ).close()
        except GrpcError as error:
            outcome[rank] = (time.monotonic() - started, str(error))
        else:
            outcome[rank] = (time.monotonic() - started, "")

    threads = [threading.Thread(target=build, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(outcome), outcome
    return outcome


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_an_expired_certificate_is_named_at_once_on_both_sides(bad_rank: int) -> None:
    """The rank with an expired certificate fails at start, naming the expiry and the setting; it
    tells the other rank (over rank 0's TLS check port), which names the rank, the expiry and the
    setting too, within a few seconds."""
    pytest.importorskip("cryptography")
    authority = _authority()
    files = [_rank_files(authority) for _ in range(2)]
    files[bad_rank] = _rank_files(authority, expired=True)
    outcome = _join_pair(files)
    seconds, error = outcome[bad_rank]
    assert seconds < 4, outcome
    assert f"rank {bad_rank}: this rank's certificate (COMMSCHED_GRPC_TLS_CERT=rank.pem)" in error, error
    assert "certificate has expired" in error and "valid from" in error, error
    seconds, other = outcome[1 - bad_rank]
    assert seconds < 4, outcome
    assert f"rank {1 - bad_rank}: rank {bad_rank} at 127.0.0.1" in other and "gave up at start" in other, (
        other
    )
    assert "its certificate (COMMSCHED_GRPC_TLS_CERT=rank.pem)" in other, other
    assert "certificate has expired" in other and "fix COMMSCHED_GRPC_TLS_CERT" in other, other


def test_a_certificate_of_another_ca_is_named_with_grpcs_reason() -> None:
    """Rank 1 with a consistent set of another CA: it refuses rank 0's certificate within about a
    second, with Python's and gRPC's reason and the setting; rank 0 hears why from it and names
    the rank, the reason and the setting."""
    pytest.importorskip("cryptography")
    outcome = _join_pair([_rank_files(_authority()), _rank_files(_authority())])
    seconds, error = outcome[1]
    assert seconds < 5, outcome
    assert "rank 1: this rank does not accept the certificate of rank 0 at 127.0.0.1:" in error, error
    assert "certificate verify failed" in error and "COMMSCHED_GRPC_TLS_CA=ca.pem" in error, error
    assert "(gRPC: " in error and "andshake failed" in error, error
    seconds, error = outcome[0]
    assert seconds < 5, outcome
    assert "rank 0: rank 1 at 127.0.0.1 does not accept this rank's certificate" in error, error
    assert _names_another_ca(error) and "rank 1's COMMSCHED_GRPC_TLS_CA" in error, error


def test_a_refused_client_certificate_is_named_on_both_sides() -> None:
    """Rank 1 trusts both CAs, but rank 0 only its own: rank 0 refuses rank 1's certificate and
    names the rank, OpenSSL's reason and its CA setting; rank 1 says its certificate was refused
    there, naming the settings."""
    pytest.importorskip("cryptography")
    job, other = _authority(), _authority()
    outcome = _join_pair([_rank_files(job), _rank_files(other, job[0], other[0])])
    seconds, error = outcome[1]
    assert seconds < 5, outcome
    assert "rank 1: rank 0 at 127.0.0.1:" in error and "refused this rank's certificate" in error, error
    assert "COMMSCHED_GRPC_TLS_CERT=rank.pem" in error and "COMMSCHED_GRPC_TLS_CA" in error, error
    seconds, error = outcome[0]
    assert seconds < 5, outcome
    assert "rank 0: the certificate of rank 1 at 127.0.0.1 does not verify" in error, error
    assert _names_another_ca(error) and "COMMSCHED_GRPC_TLS_CA=ca.pem" in error, error


def test_a_wrong_server_name_is_named_on_both_sides() -> None:
    """Rank 1 checks rank 0's certificate for a name it does not carry: both ranks name the
    mismatch and COMMSCHED_GRPC_TLS_SERVER_NAME within a few seconds."""
    pytest.importorskip("cryptography")
    authority = _authority()
    files = [_rank_files(authority), replace(_rank_files(authority), server_name="ranks.example")]
    outcome = _join_pair(files)
    for rank, (seconds, error) in enumerate(outcome):
        assert seconds < 5, outcome
        assert "COMMSCHED_GRPC_TLS_SERVER_NAME" in error and "ranks.example" in error, error
        assert "Hostname mismatch" in error or "certificate is not valid for" in error, error
    assert "rank 1: this rank does not accept the certificate of rank 0" in outcome[1][1], outcome
    assert "rank 0: rank 1 at 127.0.0.1 does not accept this rank's certificate" in outcome[0][1], outcome


def test_a_refusal_between_two_joining_ranks_is_named_by_both() -> None:
    """Rank 0 trusts both CAs, so ranks 1 and 2 join; rank 1 trusts only its own CA, which did not
    sign rank 2's certificate. Ranks 1 and 2 each name the other, the cause and the setting at
    once, instead of a missing agreement report at the stall limit."""
    pytest.importorskip("cryptography")
    first, second = _authority(), _authority()
    files = [
        _rank_files(first, first[0], second[0]),
        _rank_files(first),
        _rank_files(second, first[0], second[0]),
    ]
    outcome = _join_pair(files)
    assert all(seconds < 5 for seconds, _ in outcome), outcome
    error = outcome[1][1]
    assert "rank 1: this rank does not accept the certificate of rank 2 at 127.0.0.1:" in error, error
    assert _names_another_ca(error) and "COMMSCHED_GRPC_TLS_CA=ca.pem" in error, error
    error = outcome[2][1]
    assert "rank 2: rank 1 at 127.0.0.1:" in error and "refused this rank's certificate" in error, error
    assert "COMMSCHED_GRPC_TLS_CERT=rank.pem" in error and "rank 1's COMMSCHED_GRPC_TLS_CA" in error, error
    assert outcome[0][1], outcome  # rank 0 does not go on alone


def test_tls_settings_are_checked(tmp_path: Path) -> None:
    """All three files or none; each must be a readable PEM file; the error names the variable."""
    files = make_job_certificates(str(tmp_path), ["127.0.0.1"])
    assert config.resolve({}, environ=files).grpc_tls_cert == files["COMMSCHED_GRPC_TLS_CERT"]
    partial = {"COMMSCHED_GRPC_TLS_CA": files["COMMSCHED_GRPC_TLS_CA"]}
    with pytest.raises(config.SettingError, match="COMMSCHED_GRPC_TLS_CERT, COMMSCHED_GRPC_TLS_KEY not"):
        config.resolve({}, environ=partial)
    with pytest.raises(
        config.SettingError, match="COMMSCHED_GRPC_TLS_KEY='/nonexistent/key.pem' cannot be read"
    ):
        config.resolve({}, environ={**files, "COMMSCHED_GRPC_TLS_KEY": "/nonexistent/key.pem"})
    plain = tmp_path / "not-a-certificate.txt"
    plain.write_text("hello\n")
    with pytest.raises(config.SettingError, match="COMMSCHED_GRPC_TLS_CA=.* is not a PEM file"):
        config.resolve({}, environ={**files, "COMMSCHED_GRPC_TLS_CA": str(plain)})
    with pytest.raises(config.SettingError, match="COMMSCHED_GRPC_TLS_SERVER_NAME is set but TLS is off"):
        config.resolve({}, environ={"COMMSCHED_GRPC_TLS_SERVER_NAME": "ranks.example"})


def test_certificates_from_openssl_and_cryptography_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways of making the throwaway CA give a certificate that chains to it, for client and server use."""
    made = []
    (tmp_path / "openssl").mkdir()
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "cryptography", None)  # its import fails: the openssl path
        made.append(make_job_certificates(str(tmp_path / "openssl"), ["127.0.0.1"]))
    try:
        import cryptography  # noqa: F401
    except ImportError:
        pass
    else:
        (tmp_path / "cryptography").mkdir()
        made.append(make_job_certificates(str(tmp_path / "cryptography"), ["127.0.0.1"]))
    for files in made:
        key = Path(files["COMMSCHED_GRPC_TLS_KEY"])
        assert key.stat().st_mode & 0o077 == 0, oct(key.stat().st_mode)
        for purpose in ("sslserver", "sslclient"):
            check = subprocess.run(
                [
                    "openssl",
                    "verify",
                    "-purpose",
                    purpose,
                    "-CAfile",
                    files["COMMSCHED_GRPC_TLS_CA"],
                    files["COMMSCHED_GRPC_TLS_CERT"],
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            assert check.returncode == 0 and ": OK" in check.stdout, check.stdout + check.stderr
        assert sorted(p.name for p in key.parent.iterdir()) == ["ca.pem", "rank.key", "rank.pem"]


def test_commsched_run_grpc_tls_job(tmp_path: Path) -> None:
    """commsched-run --grpc-tls: a 2-rank gRPC job over TLS passes its checked allreduces."""
    script = str(ROOT / "tests" / "transport_ranks" / "grpc_job.py")
    command = local_launch(2, script, "--rounds", "2")
    command.insert(command.index("-n"), "--grpc-tls")
    done = subprocess.run(
        command, env=job_environment(), capture_output=True, text=True, timeout=120, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "rank 0: OK" in output and "rank 1: OK" in output, output


def test_refused_connections_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    """A flood of wrong-token joins gives one WARNING line, and the count of the others at close."""
    pair = make_pair()
    flood = 200
    try:
        channel = grpc.insecure_channel(pair[0].addresses[0])
        join = channel.unary_unary(
            JOIN_METHOD,
            request_serializer=wire.JoinRequest.SerializeToString,
            response_deserializer=wire.JoinReply.FromString,
        )
        with caplog.at_level("WARNING", logger="commsched"):
            for _ in range(flood):
                with pytest.raises(grpc.RpcError):
                    join(
                        wire.JoinRequest(rank=1, size=2, address="x:1"), metadata=[("commsched-token", "bad")]
                    )
            assert caplog.text.count("wrong job token") == 1, caplog.text
            channel.close()
            pair[0].close()
        assert f"{flood - 1} more connections refused" in caplog.text, caplog.text
    finally:
        for transport in pair:
            transport.close()


def test_speaks_tls_tells_the_two_servers_apart(tmp_path: Path) -> None:
    """The probe behind the mismatch error: a TLS server and a plaintext one, each recognised."""
    plain = make_pair()
    secure = make_pair(tls=_tls(tmp_path))
    try:
        for pair, expected in ((plain, False), (secure, True)):
            host, port = pair[0].addresses[0].rsplit(":", 1)
            assert grpc_tls.speaks_tls(host, int(port)) is expected
    finally:
        for transport in plain + secure:
            transport.close()
