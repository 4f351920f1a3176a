"""The daemon restarts under serving engines without losing the kept cache.
Real vLLM (CPU build) in its default layout, a real daemon and
keeper (``kvelastic keeper``).

Engine ``llm`` serves the prefix workload and is killed: its cache is kept.
Engine ``live`` (another tenant: another namespace) serves throughout. The
daemon is killed with SIGKILL, and a new one started: it adopts the kept
cache from its keeper and state file, ``live`` re-registers and goes on with
stock's tokens (its slabs adopted with their pages), and the
next ``llm`` starts warm, as it would have without the restart; once
``live`` exits, its cache (made through the restart) is kept too, and the
next engine of its namespace starts warm from it. The graceful stop and damaged state files are
``tests/daemon/test_keeper_daemon.py``'s.
"""

import pytest

pytest.importorskip("vllm")

from kvelastic.keeper.client import KeeperClient
from tests.daemon_proc import DaemonProcess, wait_for
from tests.keeper.test_keeper import KeeperProcess
from tests.vllm import run_engine
from tests.vllm.test_warm_restart import WARM_SHARE, kept, until_kept

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


class Engine(run_engine.Engine):
    """``kvelastic_tools.vllm_bench.warm_run`` in vLLM's default layout, or
    in one process (``in_process``: SIGKILL of its one process is the
    engine's death; in the default layout the EngineCore outlives a killed
    front end until it notices)."""

    script = ["-m", "kvelastic_tools.vllm_bench.warm_run"]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def test_kill_9_of_the_daemon_keeps_the_kept_cache_and_the_serving_engines(tiny_model, tmp_path):
    stock = run_engine.Stock(tiny_model)
    expected = stock.do("workload")["tokens"]
    stock.exit()

    settings = {"memory": "64MiB", "KVELASTIC_IDLE_GRACE": "1s"}
    daemon = DaemonProcess(tmp_path, **settings)
    keeper = KeeperProcess(tmp_path, socket=daemon.socket).start()
    engines: list[Engine] = []
    try:
        daemon.start()
        live = Engine(tiny_model, daemon, KVELASTIC_ENGINE_ID="live", KVELASTIC_TENANT_SALT="other")
        engines.append(live)
        assert live.do("workload")["tokens"] == expected
        first = Engine(tiny_model, daemon, in_process=True, KVELASTIC_ENGINE_ID="llm")
        engines.append(first)
        first.do("workload")
        before = first.do("workload")
        assert before["tokens"] == expected and before["hits"] > 0
        first.kill()
        wait_for(lambda: "llm" not in {e["engine_id"] for e in daemon.status()["engines"]}, timeout=30,
                 what="llm gone")
        blocks = wait_for(lambda: sum(kept(daemon).values()), timeout=30, what="llm's cache kept")

        daemon.kill()                                   # SIGKILL: nothing of it runs on
        daemon.stop()
        daemon = DaemonProcess(tmp_path, **settings).start()
        restart = daemon.status()["restart"]
        assert restart["state_file"] == "ok" and restart["kept_blocks"] == blocks and not restart["dropped"]
        assert sum(kept(daemon).values()) == blocks

        wait_for(lambda: [e["engine_id"] for e in daemon.status()["engines"]] == ["live"], timeout=30,
                 what="live re-registered")
        assert live.do("workload")["tokens"] == expected          # it served on, and serves now
        # Its slabs were saved as lent: adopted with their pages once its workers were back.
        wait_for(lambda: daemon.status()["restart"]["lent_adopted"] > 0, timeout=30,
                 what="live's slabs adopted with their pages")

        second = Engine(tiny_model, daemon, KVELASTIC_ENGINE_ID="llm")
        engines.append(second)
        after = second.do("workload")
        assert after["tokens"] == expected
        assert after["hits"] >= WARM_SHARE * before["hits"], (after["hits"], before["hits"])
        stats = second.do("stats")
        assert stats["adopted_blocks"] > 0 and stats["adopted_hits"] > 0, stats

        second.exit()
        live.exit()
        until_kept(daemon)                               # llm's again, and live's: kept like any engine's
        wait_for(lambda: len(kept(daemon)) == 2, what="live's cache kept too")
        # The next engine of live's namespace starts warm from what live cached
        # through the daemon's kill -9, on the very pages it wrote.
        third = Engine(tiny_model, daemon, KVELASTIC_ENGINE_ID="live2", KVELASTIC_TENANT_SALT="other")
        engines.append(third)
        warm = third.do("workload")
        assert warm["tokens"] == expected and warm["hits"] > 0, warm
        assert third.do("stats")["adopted_hits"] > 0
        third.exit()
        until_kept(daemon)
        with KeeperClient(keeper.path) as k:            # the books balance: the keeper holds what the daemon has
            wait_for(lambda: len(k.status().page_ids) == daemon.status()["pages"]["created"],
                     what="the keeper and the daemon agree")
    finally:
        for engine in engines:
            if engine.proc.poll() is None:
                engine.kill()
        daemon.stop()
        keeper.stop()
