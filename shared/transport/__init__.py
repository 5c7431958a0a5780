"""The data plane: per-layer tensors peer-to-peer (UCX), never through the bus."""
