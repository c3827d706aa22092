"""`iterserve bench`: load generator and latency report for any OpenAI-compatible server.

Python API (for the tuner's tests and scripts): `iterserve.server.bench.load.run_bench(BenchConfig(...),
stop_event)` -> `BenchResult`; see `load.py`'s docstring. The package is a client only: it never
imports the engine, the model or the server's API modules.
"""
