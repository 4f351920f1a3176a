"""The per-node daemon: books (state), the message loop (server), start-up (main)."""
