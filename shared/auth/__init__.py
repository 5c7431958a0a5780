"""Who may use the mesh's public edge: API keys (`keys.py`) and what each key may spend (`quota.py`)."""
