"""DroidMesh services: each a process (`python -m droidmesh.services.<name>`), scaled by running copies."""
