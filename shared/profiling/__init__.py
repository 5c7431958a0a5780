"""Profiling a model pair (offline) and choosing a recompute config (online); pure functions."""
