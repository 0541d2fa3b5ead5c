"""Baselines run side by side with moetune: llama.cpp (GGUF export + driver) and kt-kernel."""
