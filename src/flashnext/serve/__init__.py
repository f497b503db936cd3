"""Serving: per-slot state cache, continuous-batching engine, OpenAI-compatible HTTP server."""
