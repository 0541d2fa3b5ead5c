"""The machine fingerprint, for the tuner's modules: it lives in engine/fingerprint.py (below the
engine's profile lookup, which must not import the tuner); this module only re-exports it."""
from engine.fingerprint import ISA_FLAGS, fingerprint

__all__ = ["ISA_FLAGS", "fingerprint"]
