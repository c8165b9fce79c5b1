"""Benchmarks, their runner processes, the load test and calibration; imported by the CLI and tests only."""
