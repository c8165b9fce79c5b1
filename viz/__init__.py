"""Plotly figures built from PQCache instrumentation data (no model code here)."""
