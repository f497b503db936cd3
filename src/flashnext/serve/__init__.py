"""Serving: per-slot state cache, continuous-batching engine, OpenAI-compatible HTTP server."""

from flashnext.serve.prepare import prepare_for_inference

__all__ = ["prepare_for_inference"]
