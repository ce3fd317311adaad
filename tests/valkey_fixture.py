"""A real valkey-server for the tests: session-scoped, private, no persistence.

Import the fixtures where they are needed (``from tests.valkey_fixture import valkey_url``) or
list this module in a conftest's ``pytest_plugins``. Tests sharing the server keep apart by a
unique ``key_prefix`` each (see ``unique_prefix``), never by flushing it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from agentkv.tiers.valkey_server import ValkeyProcess


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[ValkeyProcess]:
    """One valkey-server on 127.0.0.1 and a free port for the whole session."""
    with ValkeyProcess() as server:
        yield server


@pytest.fixture(scope="session")
def valkey_url(valkey_server: ValkeyProcess) -> str:
    """``valkey://127.0.0.1:PORT/0`` of the session server."""
    return valkey_server.url


def unique_prefix() -> str:
    """A key prefix no other test uses."""
    return f"t{uuid.uuid4().hex[:12]}"
