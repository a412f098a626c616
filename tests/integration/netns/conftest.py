"""The namespace-topology tests need network namespaces; where the machine refuses them every
test here is skipped with the reason (tried, not guessed: ``netns_unavailable``)."""

from __future__ import annotations

import pytest

from fastroute.testing.netns import netns_unavailable

_REASON = netns_unavailable()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _REASON is None:
        return
    skip = pytest.mark.skip(reason=f"multi-host topology not possible here: {_REASON}")
    for item in items:
        if "integration/netns/" in str(item.path):
            item.add_marker(skip)
