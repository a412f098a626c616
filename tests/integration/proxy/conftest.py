"""Fixtures of the proxy integration tests; the helpers live in ``proxy_harness``.

(Test modules import ``proxy_harness``, never ``conftest``: several test folders have a
``conftest.py``, and importing one by that name depends on collection order.)
"""

from __future__ import annotations

import pytest
from proxy_harness import Harness


@pytest.fixture
def h() -> Harness:
    """Proxy test helpers: run, wait_until, proxy_stack, read_sse, chat_body, MODEL."""
    return Harness()
