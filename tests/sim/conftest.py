import logging

import pytest


@pytest.fixture(autouse=True)
def quiet_logs():
    """The simulator drives the real allocator through millions of events: its
    operator log lines would only bury a failure's report."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)
