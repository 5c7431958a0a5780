"""Local applications over the mesh: the demo (the main job) and the agents workload."""
