"""The causal audit of KV relay: what relaying did, measured against a randomized holdout."""
