"""vLLM's KV connector (`connector.py`, loaded by vLLM from outside), its paged-cache writes
(`pages.py`) and an offline engine driven by JSON lines (`offline.py`). Everything here but
`pages.layer_index` / `slots_of` needs vLLM, installed in its own environment."""
