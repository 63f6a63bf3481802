"""TLS for the engine's gRPC port: server-side TLS, or mutual TLS when a client CA is given.

Files are read once at startup; a missing or unreadable file is a startup error that names the
flag, never a silent fall-back to plaintext.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsConfig:
    """PEM paths: the server's certificate chain and key, and (for mTLS) the client CA."""

    cert: Path
    key: Path
    client_ca: Path | None = None

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
        config = cls(Path(cert), Path(key), None if client_ca is None else Path(client_ca))
        for flag, path in (("--tls-cert", config.cert), ("--tls-key", config.key)):
            _read(flag, path)
        if config.client_ca is not None:
            _read("--tls-ca", config.client_ca)
        return config

    @property
    def mode(self) -> str:
        return "mutual TLS" if self.client_ca is not None else "TLS"

    def server_credentials(self) -> grpc.ServerCredentials:
        ca = None if self.client_ca is None else _read("--tls-ca", self.client_ca)
        return grpc.ssl_server_credentials(
            [(_read("--tls-key", self.key), _read("--tls-cert", self.cert))],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )


def _read(flag: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from e
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag} {path}: not a PEM file")
    return data
