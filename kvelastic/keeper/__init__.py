"""The keeper: a process that only holds page descriptors, so that pages
outlive the daemon that made them (docs/warm-restarts.md)."""
