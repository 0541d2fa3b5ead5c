"""Plotly HTML reports built from the result store (see DESIGN.md)."""
