"""One-question scripts: each measured one decision recorded in docs/perf_notes/ (python -m tools.experiments.NAME).
They reuse the maintained tools' shapes, timer and floor (tools/benchmark_moe.py) and are kept runnable, not extended."""
