"""Tools around the engine: the CLI, benchmarks, evaluation, data sets, calibration, cost model, load test."""
