"""DroidMesh services: each a process (`python -m services.<name>`), scaled by running copies."""
