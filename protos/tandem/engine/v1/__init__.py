"""Package `tandem.engine.v1`: engine.proto and its generated Python stubs."""
