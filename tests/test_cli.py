"""The `moetune` command line, run as a user runs it: a fresh process per command.

Every process pays torch's import (seconds), so the module runs its commands up front, as many at a
time as there are cores, and each test checks the result of its own command. The tiny preset is
generated once, in this process, into the module's private MOETUNE_CACHE.
"""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 12
TIMEOUT_S = 300


def moetune(env: dict, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moetune_cli", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def run_all(env: dict, jobs: dict[str, list[list]]) -> dict[str, list[subprocess.CompletedProcess]]:
    """Run the jobs side by side, as many at a time as there are cores. A job is a list of
    commands run in order (a later one may use an earlier one's output); its results, in order."""
    def job(commands):
        return [moetune(env, *args) for args in commands]

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {name: pool.submit(job, commands) for name, commands in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    return {**os.environ, "MOETUNE_CACHE": str(tmp_path_factory.mktemp("moetune-cache"))}


@pytest.fixture(scope="module")
def tiny_dir(env) -> Path:
    from engine.weights.presets import ensure_preset

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOETUNE_CACHE", env["MOETUNE_CACHE"])
        return ensure_preset("tiny", progress=False)


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    dirs = {name: root / name for name in ("fp8", "int8", "int4", "empty", "mixtral", "full")}
    for name in ("empty", "mixtral", "full"):
        dirs[name].mkdir()
    cfg = json.loads((tiny_dir / "config.json").read_text())
    (dirs["mixtral"] / "config.json").write_text(json.dumps({**cfg, "model_type": "mixtral"}))
    (dirs["full"] / "keep.txt").write_text("not empty")
    return dirs


ERROR_COMMANDS = {
    "nonexistent model path": (["generate", "--model", "/nonexistent/moetune-model", "--prompt", "hi"],
                               "/nonexistent/moetune-model"),
    "directory without config.json": (["generate", "--model", "{empty}", "--prompt", "hi"], "config.json"),
    "unsupported model_type": (["generate", "--model", "{mixtral}", "--prompt", "hi"], "'mixtral'"),
    "prompt longer than the context": (["generate", "--model", "tiny", "--knob", "max_total_tokens=64",
                                        "--prompt", LONG_PROMPT], "context of 64"),
    "unknown knob": (["generate", "--model", "tiny", "--knob", "bogus=1", "--prompt", "hi"], "bogus"),
    "quantize into a non-empty dst": (["quantize", "{tiny}", "{full}", "--to", "fp8"], "not empty"),
}


@pytest.fixture(scope="module")
def runs(env, tiny_dir, work) -> dict[str, list[subprocess.CompletedProcess]]:
    paths = {**{k: str(v) for k, v in work.items()}, "tiny": str(tiny_dir)}
    quantize_then_generate = {
        fmt: [["quantize", tiny_dir, work[fmt], "--to", fmt],
              ["generate", "--model", work[fmt], "--prompt", "hello", "--max-tokens", 5]]
        for fmt in ("fp8", "int8", "int4")}
    return run_all(env, {
        **quantize_then_generate,  # the longest jobs first
        "generate": [["generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", 5]],
        "presets": [["presets"]],
        **{name: [[a.format(**paths) for a in args]] for name, (args, _) in ERROR_COMMANDS.items()},
    })


def assert_ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "error" not in r.stderr.lower(), r.stderr


def test_generate(runs, tiny_dir):
    from engine import LLM, SamplingParams

    (r,) = runs["generate"]
    assert_ok(r)
    expected = LLM(str(tiny_dir), progress=False).generate("hello", SamplingParams(max_tokens=5))[0]
    assert r.stdout.strip() and r.stdout == expected.text + "\n"
    assert "time to first token" in r.stderr and "tokens/s" in r.stderr
    assert f"{len(expected.token_ids)} generated" in r.stderr


def test_presets(runs, tiny_dir):
    (r,) = runs["presets"]
    assert_ok(r)
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()}
    assert {"tiny", "small"} <= set(lines)
    assert str(tiny_dir) in lines["tiny"] and "cached" in lines["tiny"]
    assert "not generated" in lines["small"]


@pytest.mark.parametrize("fmt, method", [("fp8", "fp8"), ("int8", "w8a8_int8"), ("int4", "moetune_int4")])
def test_quantize_then_generate(runs, work, fmt, method):
    q, g = runs[fmt]
    assert_ok(q)
    assert str(work[fmt]) in q.stdout
    cfg = json.loads((work[fmt] / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == method
    assert (work[fmt] / "tokenizer.json").is_file()
    assert_ok(g)
    assert g.stdout.strip()
    assert "time to first token" in g.stderr and "tokens/s" in g.stderr


@pytest.mark.parametrize("case", ERROR_COMMANDS)
def test_errors_are_one_line(runs, case):
    (r,) = runs[case]
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("moetune: error:")]
    assert len(errors) == 1, r.stderr
    assert "moetune: error:" not in r.stderr.replace(errors[0], ""), r.stderr
    assert ERROR_COMMANDS[case][1] in errors[0], errors[0]
