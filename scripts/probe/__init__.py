"""The probes behind scripts/decode_probe.py, one module per kind: where a decode step's time goes (timing), one
process's A/B runs and the switches they flip (ab, switches), and the app's answers and panels (app)."""
