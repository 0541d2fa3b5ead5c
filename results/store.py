"""The Parquet result store: one schema for every suite, crash-safe appends, pandas queries.

Layout (under `results_dir()`, default ~/.cache/moetune/results or $MOETUNE_RESULTS):

    parts/<time>-<pid>-<uuid>.parquet   one file per append batch, written to a .tmp name, fsynced,
                                        then renamed: a crash mid-write leaves only a .tmp that
                                        readers ignore, so it loses at most that batch
    compacted-<uuid>.parquet            parts merged by `compact()` (rows deduplicated by row_id,
                                        so a crash between writing it and deleting the parts
                                        double-counts nothing)

A row (COLUMNS, in this order; `append_rows` fills what a caller leaves out):

    row_id, run_id, suite, ts (UTC), commit, dirty, hardware_key, fingerprint_hash, model, format,
    workload (JSON text: prompt length, op and shape, ...), study, trial, knobs (JSON text),
    metric, unit, direction (minimize|maximize), median, p10, p90, p99, min, max, repeats,
    samples (list of float), status (ok|failed|pruned|wrong|timeout), error, extra (JSON text)

plus one `knob.<name>` column per knob (text; `read_results` converts numbers back).
"""
from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import numpy as np

COLUMNS = ("row_id", "run_id", "suite", "ts", "commit", "dirty", "hardware_key", "fingerprint_hash",
           "model", "format", "workload", "study", "trial", "knobs", "metric", "unit", "direction",
           "median", "p10", "p90", "p99", "min", "max", "repeats", "samples", "status", "error",
           "extra")
STATUSES = ("ok", "failed", "pruned", "wrong", "timeout")
_FLOATS = ("median", "p10", "p90", "p99", "min", "max")
_JSONS = ("workload", "knobs", "extra")


def results_dir() -> Path:
    from engine.weights.presets import cache_root

    return Path(os.environ.get("MOETUNE_RESULTS") or cache_root() / "results")


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


def stats(samples: Iterable[float]) -> dict[str, float | int]:
    """median / p10 / p90 / p99 / min / max / repeats of a list of samples (empty: NaNs, 0)."""
    s = np.asarray(list(samples), dtype=float)
    if s.size == 0:
        return {**{k: float("nan") for k in _FLOATS}, "repeats": 0}
    q = np.percentile(s, [50, 10, 90, 99])
    return {"median": float(q[0]), "p10": float(q[1]), "p90": float(q[2]), "p99": float(q[3]),
            "min": float(s.min()), "max": float(s.max()), "repeats": int(s.size)}


def _provenance() -> dict[str, Any]:
    from engine.fingerprint import fingerprint

    fp = fingerprint()
    return {"commit": fp.get("commit", "unknown"), "dirty": bool(fp.get("dirty", False)),
            "hardware_key": fp["hardware_key"], "fingerprint_hash": fp["hash"]}


def normalize_row(row: dict, suite: str, defaults: dict) -> dict:
    """A caller's dict → a full row: provenance filled, stats computed from `samples` if absent."""
    out = {c: None for c in COLUMNS}
    out.update(defaults)
    out.update({k: v for k, v in row.items() if not k.startswith("knob.") and k in COLUMNS})
    out["suite"] = row.get("suite") or suite
    out["row_id"] = row.get("row_id") or uuid.uuid4().hex
    out["ts"] = row.get("ts") or datetime.now(timezone.utc)
    samples = [float(x) for x in (row.get("samples") or [])]
    out["samples"] = samples
    if row.get("median") is None:
        out.update(stats(samples))
    out["repeats"] = int(out["repeats"] if out["repeats"] is not None else len(samples))
    out["status"] = row.get("status") or "ok"
    if out["status"] not in STATUSES:
        raise ValueError(f"status {out['status']!r} is not one of {STATUSES}")
    for k in _JSONS:
        if out[k] is not None and not isinstance(out[k], str):
            out[k] = json.dumps(out[k], sort_keys=True, default=str)
    knobs = row.get("knobs") if isinstance(row.get("knobs"), dict) else {}
    for name, value in knobs.items():
        out[f"knob.{name}"] = str(value)
    return out


def _table(rows: list[dict]):
    import pyarrow as pa

    schema = [("row_id", pa.string()), ("run_id", pa.string()), ("suite", pa.string()),
              ("ts", pa.timestamp("us", tz="UTC")), ("commit", pa.string()), ("dirty", pa.bool_()),
              ("hardware_key", pa.string()), ("fingerprint_hash", pa.string()), ("model", pa.string()),
              ("format", pa.string()), ("workload", pa.string()), ("study", pa.string()),
              ("trial", pa.int64()), ("knobs", pa.string()), ("metric", pa.string()),
              ("unit", pa.string()), ("direction", pa.string()),
              *[(c, pa.float64()) for c in _FLOATS], ("repeats", pa.int64()),
              ("samples", pa.list_(pa.float64())), ("status", pa.string()), ("error", pa.string()),
              ("extra", pa.string())]
    knob_cols = sorted({k for r in rows for k in r if k.startswith("knob.")})
    fields = [pa.field(n, t) for n, t in schema] + [pa.field(k, pa.string()) for k in knob_cols]
    data = {f.name: [r.get(f.name) for r in rows] for f in fields}
    return pa.table(data, schema=pa.schema(fields))


def _write_atomic(table, path: Path) -> None:
    import pyarrow.parquet as pq

    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def append_rows(rows: list[dict], suite: str, run_id: str | None = None,
                directory: Path | None = None) -> Path | None:
    """Append rows of one suite as one crash-safe part file; returns its path (None if no rows).

    Each row is a dict with any of COLUMNS (`knobs` may be a dict: it also becomes knob.<name>
    columns; `samples` a list of floats from which median/p10/p90/p99 are computed if missing)."""
    if not rows:
        return None
    directory = Path(directory or results_dir())
    parts = directory / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    defaults = {**_provenance(), "run_id": run_id or new_run_id()}
    table = _table([normalize_row(r, suite, defaults) for r in rows])
    name = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}.parquet"
    _write_atomic(table, parts / name)
    return parts / name


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("compacted-*.parquet")) + sorted((directory / "parts").glob("*.parquet"))


def _read_files(files: list[Path]):
    import pandas as pd
    import pyarrow.parquet as pq

    frames = []
    for f in files:
        try:
            frames.append(pq.read_table(f).to_pandas())
        except FileNotFoundError:
            continue  # compacted away between listing and reading
    if not frames:
        return pd.DataFrame(columns=list(COLUMNS))
    df = pd.concat(frames, ignore_index=True)
    return df.drop_duplicates("row_id", keep="first").reset_index(drop=True)


def read_results(directory: Path | None = None, **filters):
    """Every row as a pandas DataFrame, filtered by column equality (e.g. suite="autotune").

    knob.<name> columns come back as numbers where every value is one."""
    import pandas as pd

    df = _read_files(_files(Path(directory or results_dir())))
    for col, value in filters.items():
        if value is not None:
            df = df[df[col] == value] if col in df else df.iloc[0:0]
    for col in [c for c in df.columns if c.startswith("knob.")]:
        try:
            df[col] = pd.to_numeric(df[col])
        except (ValueError, TypeError):
            pass
    return df.sort_values("ts", kind="stable").reset_index(drop=True) if len(df) else df


def compact(directory: Path | None = None, min_parts: int = 2) -> Path | None:
    """Merge every part file (and older compacted files) into one; safe against crashes and
    concurrent appends (only files listed at the start are merged, under a lock)."""
    directory = Path(directory or results_dir())
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".compact.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        files = _files(directory)
        if len(files) < min_parts:
            return None
        import pyarrow as pa

        df = _read_files(files)
        table = pa.Table.from_pandas(df, preserve_index=False)
        out = directory / f"compacted-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}.parquet"
        _write_atomic(table, out)
        for f in files:
            f.unlink(missing_ok=True)
        for tmp in (directory / "parts").glob("*.tmp"):
            if time.time() - tmp.stat().st_mtime > 3600:
                tmp.unlink(missing_ok=True)  # left by a writer that crashed an hour ago or more
        return out
