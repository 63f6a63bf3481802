"""Namespace for the `tandem` protobuf packages."""
