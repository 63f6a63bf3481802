"""The gateway's HTTP server: the Starlette app, its worker processes, request limits, the state
every route shares, the OpenAPI document and the metrics."""
