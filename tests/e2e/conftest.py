import pytest

from .server import BOOKS_CHECKED


@pytest.fixture(autouse=True, scope="module")
def books_balanced():
    """Every e2e module ends with its servers' books balanced: each server started with
    --enable-debug-endpoints was checked as it stopped (tests/e2e/server.py); any whose
    accepted requests did not all end, or that kept per-request state or KV blocks, fails
    the module's last test."""
    BOOKS_CHECKED.clear()
    yield
    failed = [f"{server.url}: {exc}" for server, exc in BOOKS_CHECKED if exc is not None]
    BOOKS_CHECKED.clear()
    assert not failed, "\n".join(failed)
