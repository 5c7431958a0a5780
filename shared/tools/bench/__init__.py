"""Benchmark suites behind `droidmesh bench ...`: they print tables and write JSON/PNG, never assert."""
