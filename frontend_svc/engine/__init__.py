"""The gateway's side of the engine contract: the client and its Stream, the pool of engines
(routing with retry; engines joining and leaving; calls on every engine), what they tell the
rest of the gateway (events), health, the types and protobuf messages that cross."""
