"""Tandem protobuf contract and generated stubs (see scripts/gen_protos.sh), and how both
services run grpcio (``grpc_runtime``, the one hand-written module here)."""
