import pytest

from tests.daemon_proc import DaemonProcess


@pytest.fixture
def daemon(tmp_path):
    """A running daemon (host backend, 64 MiB budget, metrics on a free port)."""
    proc = DaemonProcess(tmp_path).start()
    yield proc
    proc.stop()


@pytest.fixture
def daemon_factory(tmp_path):
    """Start daemons with custom settings: ``daemon_factory(memory="32MiB")``."""
    started = []

    def make(**kw):
        proc = DaemonProcess(tmp_path, **kw).start()
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()
