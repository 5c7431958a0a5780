"""DroidMesh inside other serving engines: a mesh receiver that lives in a foreign process.

`bridge.py` is the engine-free half (the mesh's lookup, plan and pull, run on a loop thread of
its own, with synchronous calls for an engine's hooks); `vllm/` is vLLM's KV connector over it.
"""
