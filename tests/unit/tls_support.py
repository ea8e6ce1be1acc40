"""A local HTTPS server whose certificate names one host only (no IP address), for tests that must show a client
verified the certificate against that name while connecting to 127.0.0.1 (tests/unit/test_agent_browse_hostile.py)."""

from __future__ import annotations

import datetime
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from tempfile import TemporaryDirectory

from tests.unit.test_agent_browse import ARTICLE


def self_signed(host: str, folder: Path) -> tuple[Path, Path]:
    """(certificate, key) PEM files: an EC key and a self-signed certificate for `host` (its only name)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class _Article(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(ARTICLE)))
        self.end_headers()
        self.wfile.write(ARTICLE)


@contextmanager
def tls_site(host: str) -> Iterator[tuple[int, ssl.SSLContext, list[str]]]:
    """(port on 127.0.0.1, a client context trusting only its certificate, the SNI names the server saw)."""
    with TemporaryDirectory() as folder:
        cert, key = self_signed(host, Path(folder))
        server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_context.load_cert_chain(cert, key)
        seen: list[str] = []
        server_context.sni_callback = lambda _sock, name, _ctx: seen.append(name)
        client_context = ssl.create_default_context(cafile=str(cert))
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Article)
        server.daemon_threads = True
        server.socket = server_context.wrap_socket(server.socket, server_side=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield server.server_address[1], client_context, seen
        finally:
            server.shutdown()
            server.server_close()
