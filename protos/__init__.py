"""Tandem protobuf contract and generated stubs (see scripts/gen_protos.sh)."""
