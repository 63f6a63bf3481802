"""Where the engines are and how to reach them: ``--engine`` parsed into targets, a DNS target
looked up into addresses, and the TLS credentials of the engine channels."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from dataclasses import dataclass

import grpc

from frontend_svc.config import TlsClientConfig


@dataclass(frozen=True)
class EngineTarget:
    """One entry of ``--engine``: a fixed address, or a DNS name to resolve again and again."""

    host: str
    port: int
    dns: bool = False

    @property
    def address(self) -> str:
        return _join(self.host, self.port)


def parse_engine_targets(spec: str) -> list[EngineTarget]:
    """``HOST:PORT[,HOST:PORT...]`` with ``dns:///NAME:PORT`` entries; ValueError if malformed."""
    targets = []
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        dns = entry.startswith("dns:///")
        rest = entry[len("dns:///") :] if dns else entry
        if "://" in rest or rest.startswith("dns:"):
            raise ValueError(f"engine address {entry!r}: only HOST:PORT and dns:///NAME:PORT")
        host, sep, port = rest.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        host = host[1:-1] if bracketed else host
        malformed = "[" in host or "]" in host or (":" in host and not bracketed)
        if malformed or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"engine address {entry!r} is not HOST:PORT")
        targets.append(EngineTarget(host, int(port), dns))
    if not targets:
        raise ValueError("no engine address given")
    return targets


def _join(host: str, port: int) -> str:
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    return f"{host}:{port}"


def channel_credentials(tls: TlsClientConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials for the engine channels (None: plaintext). Reads the files once."""
    if not tls.enabled:
        return None

    def read(flag: str, path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"{flag} {path}: {e.strerror or e}") from e

    return grpc.ssl_channel_credentials(
        root_certificates=read("--tls-ca", tls.ca),
        private_key=read("--tls-key", tls.key),
        certificate_chain=read("--tls-cert", tls.cert),
    )


async def resolve(target: EngineTarget) -> set[str]:
    """The addresses (``HOST:PORT``) a DNS target names now; OSError/UnicodeError if the
    lookup fails."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        target.host, target.port, type=socket.SOCK_STREAM
    )
    return {_join(str(i[4][0]), target.port) for i in infos}
