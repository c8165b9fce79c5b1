"""Serving: loading models, reading documents, document sessions, the session pool, generation."""
