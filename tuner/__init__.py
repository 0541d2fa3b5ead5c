"""Knob search, machine fingerprint and roofline probe, tuned profiles (see DESIGN.md)."""
