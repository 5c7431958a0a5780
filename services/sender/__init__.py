"""Sender: hosts a model, prefills contexts, keeps per-layer KV + E, announces, serves UCX pulls."""
