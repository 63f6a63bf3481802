"""Tandem's gateway: an OpenAI-compatible HTTP server in front of a gRPC engine.

Runs on CPU only and never imports torch: it validates requests, renders chat templates,
tokenizes, streams token ids to the engine over one bidirectional gRPC stream, and detokenizes
what comes back.
"""

from __future__ import annotations

__version__ = "0.1.0"
