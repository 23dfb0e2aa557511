"""Helpers for the tests (plain modules; fixtures live in tests/conftest.py)."""
