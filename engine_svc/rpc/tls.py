"""TLS for the engine's gRPC port: server-side TLS, or mutual TLS when a client CA is given.

Files are read once, when the flags are parsed; a missing or unreadable file is a startup error
that names the flag, never a silent fall-back to plaintext.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsConfig:
    """PEM contents: the server's certificate chain and key, and (for mTLS) the client CA."""

    cert: bytes
    key: bytes
    client_ca: bytes | None = None

    @classmethod
    def from_flags(
        cls, cert: str | None, key: str | None, client_ca: str | None
    ) -> TlsConfig | None:
        """None when no TLS flag is given; ValueError naming the flag when the set is partial."""
        if cert is None and key is None:
            if client_ca is not None:
                raise ValueError("--tls-ca needs --tls-cert and --tls-key (the server's own pair)")
            return None
        if cert is None or key is None:
            missing = "--tls-cert" if cert is None else "--tls-key"
            raise ValueError(f"TLS needs both --tls-cert and --tls-key; {missing} is missing")
        return cls(
            _read("--tls-cert", Path(cert)),
            _read("--tls-key", Path(key)),
            None if client_ca is None else _read("--tls-ca", Path(client_ca)),
        )

    @property
    def mode(self) -> str:
        return "mutual TLS" if self.client_ca is not None else "TLS"

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


def _read(flag: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from e
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag} {path}: not a PEM file")
    return data
