"""Baselines run side by side with moetune: llama.cpp and ik_llama.cpp (GGUF export + drivers) and kt-kernel."""
