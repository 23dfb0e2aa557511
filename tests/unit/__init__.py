"""unit tests (see tests/conftest.py for the kinds)."""
