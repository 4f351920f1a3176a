"""Client side of the daemon link: ``EngineClient`` (block pool) and ``WorkerClient`` (KV arena)."""
