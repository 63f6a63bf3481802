"""The gateway's side of the engine contract: the client and its Stream, the pool of engines,
routing, health, the types and protobuf messages that cross."""
