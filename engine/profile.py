"""Tuned profiles: a small TOML file per (hardware key, model shape + format).

    [meta]          schema_version, hardware_key, fingerprint (table), model_key, commit, study,
                    trial, objective, gain, gain_spread, created
    [knobs]         knob name = value (names from engine.knobs.CATALOGUE)
    [kernel_tables] per op: rows of {bucket..., knob values} (filled by the kernel tier)

The tuner writes them (tuner/autotune.py); the engine and `moetune serve` load one by fingerprint
lookup or by explicit path; a profile made on another machine (other hardware key) is refused
unless forced. The format lives here, below the tuner, so that the engine never imports the tuner.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from engine.errors import MoetuneError

SCHEMA_VERSION = 1


@dataclass
class Profile:
    meta: dict
    knobs: dict = field(default_factory=dict)
    kernel_tables: dict = field(default_factory=dict)
    path: Path | None = None

    @property
    def hardware_key(self) -> str:
        return self.meta.get("hardware_key", "")

    @property
    def model_key(self) -> str:
        return self.meta.get("model_key", "")


def model_key(cfg, fmt: str, quantized_head: bool = False) -> str:
    """The model's shape and weight format, e.g. deepseek_v3-d2048-l3-e64k6-i1408-h16-bf16; "-qhead" after it
    where the LM head is quantized too (a different decode step: the head is its largest single read)."""
    return (f"{cfg.model_type}-d{cfg.hidden_size}-l{cfg.num_hidden_layers}-e{cfg.n_routed_experts}"
            f"k{cfg.num_experts_per_tok}-i{cfg.moe_intermediate_size}-h{cfg.num_attention_heads}-{fmt}"
            f"{'-qhead' if quantized_head else ''}")


def profile_dir() -> Path:
    from engine.weights.presets import cache_root

    return Path(os.environ.get("MOETUNE_PROFILES") or cache_root() / "profiles")


def profile_path(hardware_key: str, mkey: str, directory: Path | None = None) -> Path:
    return (directory or profile_dir()) / f"{hardware_key}__{mkey}.toml"


def save_profile(profile: Profile, path: Path) -> Path:
    """Write atomically (temp file + rename): a crash never leaves half a profile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": {"schema_version": SCHEMA_VERSION, **profile.meta}, "knobs": profile.knobs,
           "kernel_tables": profile.kernel_tables}
    tmp = path.with_suffix(path.suffix + f".tmp-{os.getpid()}")
    tmp.write_bytes(tomli_w.dumps(doc).encode())
    tmp.replace(path)
    profile.path = path
    return path


def load_profile(path: str | Path, force: bool = False) -> Profile:
    """Read and check a profile; refuse one from another machine unless `force`."""
    from engine.fingerprint import fingerprint

    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise MoetuneError(f"profile {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise MoetuneError(f"profile {path} is not valid TOML ({e})") from None
    meta = doc.get("meta", {})
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise MoetuneError(f"profile {path} has schema version {meta.get('schema_version')}, "
                           f"this moetune reads {SCHEMA_VERSION}")
    here = fingerprint()["hardware_key"]
    if meta.get("hardware_key") != here and not force:
        raise MoetuneError(f"profile {path} was tuned on another machine (hardware key "
                           f"{meta.get('hardware_key')}, this one is {here}); re-tune, or force it")
    return Profile(meta, dict(doc.get("knobs", {})), dict(doc.get("kernel_tables", {})), path)


def find_profile(mkey: str, directory: Path | None = None) -> Profile | None:
    """This machine's profile for the model, if one was tuned."""
    from engine.fingerprint import fingerprint

    path = profile_path(fingerprint()["hardware_key"], mkey, directory)
    return load_profile(path) if path.is_file() else None
