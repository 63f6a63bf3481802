"""Namespace for the `tandem.engine` protobuf packages."""
