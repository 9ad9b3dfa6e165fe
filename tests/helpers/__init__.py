"""Shared test helpers (importable as tests.helpers)."""
