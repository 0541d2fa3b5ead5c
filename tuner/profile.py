"""Tuned profiles, for the tuner's modules: the format lives in engine/profile.py (the engine reads
profiles without importing the tuner); this module only re-exports it."""
from engine.profile import (SCHEMA_VERSION, Profile, find_profile, load_profile, model_key, profile_dir,
                            profile_path, save_profile)

__all__ = ["SCHEMA_VERSION", "Profile", "find_profile", "load_profile", "model_key", "profile_dir",
           "profile_path", "save_profile"]
