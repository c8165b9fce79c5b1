"""Evaluation: case runner, formats, metrics, sources, data sets, recall study; for the CLI, benchmarks, tests."""
