import pytest

from tests.daemon.engines import EngineProcess, with_engine_token


@pytest.fixture
def engines():
    started = []

    def make(daemon, engine_id, **cfg):
        proc = EngineProcess(daemon.socket, engine_id, **with_engine_token(started, engine_id, cfg))
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.close()
