"""A small KV-aware router: ``kvelastic router``.

It sends each OpenAI request to the engine that already holds the longest
prefix of its tokens, as Dynamo's KV indexer reports it from the engines' own
vLLM KV events (``docs/kv-events.md``). ``policy`` decides (no I/O),
``indexer`` asks the indexer, ``proxy`` is the HTTP shell.
"""
