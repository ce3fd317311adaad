"""The remote tier over TLS against a real valkey-server behind a TLS proxy: CA verification and
client certificates."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agentkv.tiers.remote import RemoteBlocks
from agentkv.tiers.results import BlockStatus
from agentkv.tiers.valkey_server import ValkeyProcess
from tests.unit import remote_fixtures
from tests.unit.remote_fixtures import content, keys, zeros
from tests.valkey_fixture import unique_prefix, valkey_server, valkey_url  # noqa: F401

remote = remote_fixtures.remote


# ------------------------------------------------------------------------------------- TLS


def _certificates(directory: Path) -> dict[str, str]:
    """A test CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    paths: dict[str, str] = {}

    def issue(name: str, issuer: Any, issuer_key: Any, *, ca: bool, san: bool) -> tuple[Any, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer or subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            import ipaddress

            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        paths[f"{name}_cert"] = str(directory / f"{name}.crt")
        paths[f"{name}_key"] = str(directory / f"{name}.key")
        return cert, key

    ca_cert, ca_key = issue("ca", None, None, ca=True, san=False)
    issue("server", ca_cert.subject, ca_key, ca=False, san=True)
    issue("client", ca_cert.subject, ca_key, ca=False, san=False)
    return paths


class _TlsProxy:
    """TLS in front of the plain test server (the bundled valkey-server has no TLS built in):
    terminates TLS with the server certificate, optionally requires a client certificate, and
    relays bytes both ways. Real handshakes and verification on the client side."""

    def __init__(self, target_port: int, certs: dict[str, str], *, client_certs: bool) -> None:
        import socket
        import ssl
        import threading

        self._target = target_port
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(certs["server_cert"], certs["server_key"])
        if client_certs:
            self._context.verify_mode = ssl.CERT_REQUIRED
            self._context.load_verify_locations(certs["ca_cert"])
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[Any] = [self._listener]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        import socket
        import ssl
        import threading

        while True:
            try:
                raw_client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                client = self._context.wrap_socket(raw_client, server_side=True)
            except (ssl.SSLError, OSError):
                raw_client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self._target))
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._relay, args=(source, sink), daemon=True).start()

    @staticmethod
    def _relay(source: Any, sink: Any) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.close()

    def close(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    pytest.importorskip("cryptography")
    return _certificates(tmp_path_factory.mktemp("tls"))


@pytest.mark.parametrize("direct", [True, False])
def test_tls_with_ca_verification(
    remote: Any,
    valkey_server: ValkeyProcess,  # noqa: F811
    certs: dict[str, str],
    direct: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(RemoteBlocks, "direct", direct)
    proxy = _TlsProxy(valkey_server.port, certs, client_certs=False)  # type: ignore[arg-type]
    try:
        url = f"valkeys://127.0.0.1:{proxy.port}/0"
        r = remote(url, tls_ca=certs["ca_cert"])
        ks = keys(3, salt=f"tls-{direct}")
        assert all(x.ok for x in r.put_many(ks, [content(k) for k in ks]))
        out = zeros(3)
        assert all(x.ok for x in r.get_many(ks, out))
        assert all(np.array_equal(o, content(k)) for o, k in zip(out, ks, strict=True))
        # Without the CA the server certificate does not verify: error results, no exception.
        untrusted = remote(url, backoff_s=0.0)
        assert not untrusted.ping()
        result = untrusted.get_many(ks[:1], zeros(1))[0]
        assert result.status is BlockStatus.ERROR and "certificate" in str(result.error).lower()
        # The plain scheme against the TLS port fails cleanly too.
        plain = remote(f"valkey://127.0.0.1:{proxy.port}/0", backoff_s=0.0, op_timeout_s=1.0)
        assert plain.get_many(ks[:1], zeros(1))[0].status is BlockStatus.ERROR
    finally:
        proxy.close()


def test_tls_client_certificate(
    remote: Any,
    valkey_server: ValkeyProcess,  # noqa: F811
    certs: dict[str, str],
) -> None:
    proxy = _TlsProxy(valkey_server.port, certs, client_certs=True)  # type: ignore[arg-type]
    try:
        url = f"valkeys://127.0.0.1:{proxy.port}/0?tls_ca={certs['ca_cert']}"
        anonymous = remote(url, backoff_s=0.0, op_timeout_s=1.0)
        assert not anonymous.ping()
        with_cert = remote(url, tls_cert=certs["client_cert"], tls_key=certs["client_key"])
        assert with_cert.ping()
        [k] = keys(1, salt="mtls")
        assert with_cert.put_many([k], [content(k)])[0].ok
        assert with_cert.get_many([k], zeros(1))[0].ok
    finally:
        proxy.close()
