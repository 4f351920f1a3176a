"""Deterministic simulation of a node: the real allocator and engine pools on
a fake clock, with faults; ``run.run_seed`` replays a seed exactly."""
