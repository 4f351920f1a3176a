import pytest

from tests.daemon.engines import EngineProcess


@pytest.fixture
def engines():
    started = []

    def make(daemon, engine_id, **cfg):
        if cfg.get("role") == "worker" and "token" not in cfg:    # its engine's secret, as vLLM hands it over
            cfg["token"] = next(e for e in reversed(started) if e.engine_id == engine_id
                                and e.role == "engine").state()["token"]
        proc = EngineProcess(daemon.socket, engine_id, **cfg)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.close()
