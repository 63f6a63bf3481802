"""``python -m engine_svc.healthcheck``: exit 0 iff the engine's grpc.health.v1 says SERVING.

The container HEALTHCHECK and docker-compose run this every few seconds, so it imports only grpc
and grpc_health (never torch) and answers in well under a second; those two are imported inside
the functions, so that running the module can set GRPC_VERBOSITY first (gRPC reads it at
import). Any other outcome (NOT_SERVING while the engine drains, an unknown service, no answer
within ``--timeout``, a TLS failure) is printed to stderr and exits 1 (so does a usage error:
Docker reserves exit code 2).

    python -m engine_svc.healthcheck                              # 127.0.0.1:50051, service ""
    python -m engine_svc.healthcheck --service tandem.engine.v1.Engine
    python -m engine_svc.healthcheck --tls-ca ca.pem --tls-cert client.pem --tls-key client.key
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m engine_svc.healthcheck",
        description="Exit 0 iff the engine's grpc.health.v1 Check answers SERVING.",
    )
    p.add_argument("--address", default="127.0.0.1:50051", help="engine HOST:PORT")
    p.add_argument(
        "--service", default="", help="service to check ('' = the whole server, the default)"
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.add_argument("--tls-ca", default=None, help="PEM roots to verify the engine's certificate")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate chain (mutual TLS)")
    p.add_argument("--tls-key", default=None, help="PEM client private key (mutual TLS)")
    p.add_argument(
        "--tls-server-name",
        default=None,
        help="name to verify the engine's certificate against (default: the address's host)",
    )
    args = p.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        p.error("--tls-cert and --tls-key go together")
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    return args


def channel_credentials(
    ca: str | None, cert: str | None, key: str | None
) -> grpc.ChannelCredentials | None:
    """TLS credentials from PEM files, or None (plaintext) when no TLS file is given.

    Without ``ca`` the engine's certificate is verified against the system roots.
    """
    import grpc

    if ca is None and cert is None and key is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca),
        private_key=_read(key),
        certificate_chain=_read(cert),
    )


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def check(
    address: str,
    service: str = "",
    timeout: float = 3.0,
    credentials: grpc.ChannelCredentials | None = None,
    server_name: str | None = None,
) -> str | None:
    """None when ``service`` at ``address`` is SERVING, else why not (one line)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = [] if server_name is None else [("grpc.ssl_target_name_override", server_name)]
    if credentials is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, credentials, options=options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            name = code.name if code is not None else "ERROR"
            detail = e.details() if isinstance(e, grpc.Call) else str(e)
            if code == grpc.StatusCode.NOT_FOUND:
                return f"{address}: health server does not know service {service!r}"
            return f"{address}: {name}: {detail}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return f"{address}: service {service!r} is {status}"
    return None


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:  # usage error: argparse exits 2, which Docker reserves
        return 0 if e.code in (0, None) else 1
    try:
        credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    except OSError as e:
        print(f"unhealthy: cannot read TLS file: {e}", file=sys.stderr)
        return 1
    reason = check(args.address, args.service, args.timeout, credentials, args.tls_server_name)
    if reason is not None:
        print(f"unhealthy: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # Keep gRPC's own log lines (a failed TLS handshake logs at INFO) out of the reason Docker
    # shows for the check; an explicit GRPC_VERBOSITY still wins.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    sys.exit(main())
