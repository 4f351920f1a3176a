"""The plugin's state in this process: one ``PluginState``, made once by ``state()``.

vLLM loads the plugin in every process it starts (front end, EngineCore,
workers; all in one process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and
each side keeps here what it set up: the EngineCore its link to the daemon,
a worker its ``WorkerClient``. Settings come from ``Config``, read once, the
one place ``KVELASTIC_*`` variables are read.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import TYPE_CHECKING

from kvelastic.config import Config

if TYPE_CHECKING:
    from kvelastic.client.worker import WorkerClient
    from kvelastic_vllm.link import EngineLink


def engine_id_of(config: Config) -> str:
    """This engine's name: ``KVELASTIC_ENGINE_ID``, else the host name and the
    pid of the first process that loads the plugin. ``register()`` exports it,
    so the EngineCore and the workers started from there read the same name."""
    return config.engine_id or f"{socket.gethostname()}-{os.getpid()}"


@dataclasses.dataclass
class PluginState:
    config: Config
    engine_id: str
    registered: bool = False               # vLLM is patched in this process
    link: EngineLink | None = None         # EngineCore: the engine registered with the daemon
    worker: WorkerClient | None = None     # worker: its link, opened at the first KV allocation

    def engine(self) -> EngineLink:
        """The registered engine, for the block pool vLLM builds after registration."""
        if self.link is None:
            raise RuntimeError("kvelastic: this engine did not register with the daemon "
                               "(the plugin's get_kv_cache_configs hook did not run)")
        return self.link

    def attach(self, link: EngineLink) -> EngineLink:
        """``link`` is the engine the next ElasticBlockPool serves and the scheduler hooks see."""
        self.link = link
        return link

    def hash_seed(self) -> str:
        """The registered engine's namespace seed for block hashes ("" before
        registration, or from a daemon that gives none)."""
        return self.link.client.hash_seed if self.link is not None else ""

    def detach(self) -> None:
        """The engine is closed: the scheduler hooks pass through again."""
        self.link = None


_state: PluginState | None = None


def state() -> PluginState:
    """This process's plugin state; a bad ``KVELASTIC_*`` value raises
    ``ConfigError`` naming the variable (and no state is kept)."""
    global _state
    if _state is None:
        config = Config.from_env()
        _state = PluginState(config, engine_id_of(config))
    return _state
