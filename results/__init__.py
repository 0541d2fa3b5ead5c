"""Parquet result store (see DESIGN.md)."""
