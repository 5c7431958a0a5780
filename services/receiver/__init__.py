"""Receiver: hosts a model, serves generate requests, reuses senders' caches or falls back."""
