"""HTTP routes, one file per API area."""
