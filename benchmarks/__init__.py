"""Benchmarks of the retrieval framework: each ``bench_*`` module is run from the repository root as
``python -m benchmarks.bench_x`` (the Makefile's ``bench-*`` targets), and writes JSON + Markdown to
``benchmarks/results/``. ``_harness`` is what they share: the machine record and the result writers."""
