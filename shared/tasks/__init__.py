"""Tasks and their scoring, apart from any model zoo: what a task asks (`spec`), how a
LongBench-style row becomes token ids and an answer text (`rows`), the JSONL format (`jsonl`),
the metrics (`metrics`), and the one scorer of reuse plans (`scorer`, `report`).

Used by `droidmesh eval`, `droidmesh profile`, `droidmesh bench quality` and `droidmesh demo`
on the zoo's generated rows and on a user's own JSONL alike.
"""
