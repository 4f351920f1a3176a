"""Every reason the daemon can reject a message for has its counter from start-up."""

import pathlib
import re

from kvelastic.metrics import REJECT_REASONS

SERVER = pathlib.Path(__file__).resolve().parents[2] / "kvelastic" / "daemon" / "server.py"


def test_every_rejection_reason_is_declared():
    source = SERVER.read_text()
    used = set(re.findall(r'Rejected\("([a-z_]+)"', source)) | set(re.findall(r'rejected\.labels\("([a-z_]+)"\)', source))
    assert used and used <= set(REJECT_REASONS), used - set(REJECT_REASONS)


def test_counters_exist_before_any_rejection(daemon):
    text = daemon.metrics()
    for reason in REJECT_REASONS:
        assert f'kvelastic_rejected_messages_total{{reason="{reason}"}} 0.0' in text
    assert 'kvelastic_grant_latency_seconds_count{device="0"} 0.0' in text
