"""Benchmark suites and baseline drivers (see DESIGN.md)."""
