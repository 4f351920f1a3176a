import pytest

from tests.daemon.engines import EngineProcess


@pytest.fixture
def engines():
    started = []

    def make(daemon, engine_id, **cfg):
        proc = EngineProcess(daemon.socket, engine_id, **cfg)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.close()
