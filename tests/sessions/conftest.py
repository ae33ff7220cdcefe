from __future__ import annotations

import pytest_asyncio
from asgiref.sync import sync_to_async
from django.db import connections


@pytest_asyncio.fixture
async def close_thread_connections():
    """The ORM calls of an async test run in asgiref's sync thread, which keeps its own connection
    open; close it so the test database can be dropped at the end of the run."""
    yield
    await sync_to_async(connections.close_all)()
