"""The ``net`` fixture: receivers / senders of one test, closed at teardown."""
from __future__ import annotations

import pytest

from .common import Net


@pytest.fixture
def net(tmp_path):
    n = Net(tmp_path)
    yield n
    n.close()
