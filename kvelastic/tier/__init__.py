"""The tier below device memory: its index (``index.py``) and its stores (``disk.py``); docs/tier.md."""
