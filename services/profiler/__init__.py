"""Profiler: profiles model pairs offline on request and publishes their recompute configs."""
