"""kvelastic: an elastic virtual-memory KV-cache allocator for LLM serving."""

__version__ = "0.1.0"
