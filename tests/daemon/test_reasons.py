"""Every reason the daemon can reject a message for has its counter from start-up."""

from kvelastic import protocol as p
from kvelastic.daemon.allocator import Rejected
from kvelastic.metrics import REJECT_REASONS


def test_every_rejection_reason_is_declared():
    # One enum is the whole list: the metric's series, the replies' reasons.
    assert set(REJECT_REASONS) == {r.value for r in p.Reason} and len(REJECT_REASONS) == len(p.Reason)
    exc = Rejected(p.Reason.BUSY, "x")
    assert exc.reason is p.Reason.BUSY and p.Error(reason=exc.reason.value, message="x").reason == "busy"


def test_counters_exist_before_any_rejection(daemon):
    text = daemon.metrics()
    for reason in REJECT_REASONS:
        assert f'kvelastic_rejected_messages_total{{reason="{reason}"}} 0.0' in text
    assert 'kvelastic_grant_latency_seconds_count{device="0"} 0.0' in text
