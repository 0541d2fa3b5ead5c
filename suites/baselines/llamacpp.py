"""The llama.cpp baseline: the model exported to GGUF, run by llama-cpp-python in a worker process.

    python -m suites.baselines.llamacpp --model small --type bf16 --prompt-len 128 --decode 32

Needs the optional extra `baselines` (`pip install -e .[baselines]`; pip compiles llama.cpp with
the machine's native flags, ≈15 minutes on 2 cores, then caches the wheel). The worker process
keeps llama.cpp's thread pool and memory apart from ours (and an assertion inside llama.cpp
aborts only the worker).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from suites.baselines.client import BaselineError, Worker, WorkerOwner

WORKER = Path(__file__).resolve().parent / "llamacpp_worker.py"
BUILD_FLAGS = 'CMAKE_ARGS="-DGGML_NATIVE=ON"'  # how the README installs the extra (recorded with results)


def have_llama_cpp() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def require_llama_cpp() -> None:
    if not have_llama_cpp():
        raise BaselineError("llama.cpp baseline needs the extra: "
                            f"{BUILD_FLAGS} pip install -e '.[baselines]' (compiles llama.cpp, ≈15 min on 2 cores)")


def gguf_path(model: str, gtype: str) -> Path:
    """Where the export of `model` in `gtype` is cached (keyed by the exporter's layout version and the
    checkpoint's config and index)."""
    from engine.weights.presets import cache_root, resolve_model

    from suites.baselines.gguf_export import LAYOUT_VERSION

    src = resolve_model(model, progress=True)
    key = hashlib.sha256(f"layout {LAYOUT_VERSION}".encode())
    for name in ("config.json", "model.safetensors.index.json"):
        if (src / name).is_file():
            key.update((src / name).read_bytes())
    return cache_root() / "gguf" / f"{Path(str(model)).name}-{key.hexdigest()[:10]}-{gtype}.gguf"


def ensure_gguf(model: str, gtype: str) -> Path:
    """The cached export, written first if missing."""
    from suites.baselines.gguf_export import export_gguf

    path = gguf_path(model, gtype)
    if not path.is_file():
        export_gguf(model, path, gtype)
    return path


class GgufEngine(WorkerOwner):
    """A GGUF loaded in a worker process speaking the llama.cpp workers' ops (info, load, greedy, time,
    time_batch): llamacpp_worker.py here, ikllama_worker.py for the ik_llama.cpp fork."""

    engine = "?"

    def __init__(self, cmd: list[str], gguf: Path, load_args: dict, timeout_s: float = 600.0):
        self.worker = Worker(cmd, self.engine, timeout_s=timeout_s)
        try:
            self.info = self.worker.call("info")
            self.load = self.worker.call("load", path=str(gguf), **load_args)
        except BaselineError:
            self.worker.close()
            raise

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        return self.worker.call("greedy", prompt=list(prompt), n=n)["tokens"]

    def run_once(self, prompt: list[int], decode: int) -> dict:
        """Same fields as suites.e2e.run_once: ttft_s, decode_s, decoded (tokens after the first), by
        the engine's own clock; "python": ttft_s / decode_s through the Python binding's loop."""
        r = self.worker.call("time", prompt=list(prompt), n_decode=max(decode - 1, 1))
        return {"ttft_s": r["ttft_s"], "decode_s": r["decode_s"], "decoded": r["decoded"], "python": r["python"]}

    def run_batch(self, prompts: list[list[int]], decode: int) -> dict:
        """Same fields as suites.e2e.run_batch: B sequences decoded together (the batch API)."""
        r = self.worker.call("time_batch", prompts=[list(p) for p in prompts], n_decode=max(decode - 1, 1))
        return {"ttft_s": r["ttft_s"], "decode_s": r["decode_s"], "decoded": r["decoded"], "python": r["python"]}


class LlamaCpp(GgufEngine):
    """A loaded GGUF in a llama-cpp-python worker."""

    engine = "llama.cpp"

    def __init__(self, gguf: Path, threads: int, n_ctx: int = 4096, n_batch: int = 512, repack: bool | None = None):
        """repack: llama.cpp's extra buffer types (its weight repacking; AMX's on an AMX CPU): True / False,
        or None: on, as llama.cpp's default, unless a first decode then kills the worker (its AMX back end
        aborted so on an AMX VM, GGML_ASSERT(*cur_backend_id != -1), on the `small` Q8_0 GGUF): then off,
        as its CLI's `--no-repack`, the reason in settings["repack_note"]."""
        require_llama_cpp()
        args = {"threads": threads, "n_ctx": n_ctx, "n_batch": n_batch}
        start = lambda on: super(LlamaCpp, self).__init__([sys.executable, str(WORKER)], gguf,  # noqa: E731
                                                          {**args, "repack": on})
        note = None
        if repack is None:
            try:
                start(True)
                self.greedy([1, 2], 1)  # the first decode: where the scheduler finds no back end for an op
                repack = True
            except BaselineError as e:
                self.worker.close()
                note = f"repacking off: with it, llama.cpp's worker failed its first decode ({str(e)[:200]})"
                repack = False
                start(False)
        else:
            start(bool(repack))
        self.settings = {"engine": "llama.cpp", "threads": threads, "n_ctx": n_ctx, "n_batch": n_batch,
                         "repack": bool(repack), **({"repack_note": note} if note else {}),
                         "gguf": gguf.name, "version": self.info["llama_cpp_python"],
                         "system_info": self.info["system_info"], "build": BUILD_FLAGS,
                         "model_bytes": self.load["model_bytes"],
                         "rss_load_bytes": self.load["rss_after"] - self.load["rss_before"]}


def main(argv=None) -> int:
    import statistics

    import torch

    ap = argparse.ArgumentParser(prog="python -m suites.baselines.llamacpp", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--type", default="bf16", choices=("f32", "bf16", "q8_0", "q4_0"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    with LlamaCpp(ensure_gguf(args.model, args.type), args.threads) as ll:
        prompt = torch.randint(2, ll.load["n_vocab"], (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
        ll.run_once(prompt, 2)
        runs = [ll.run_once(prompt, args.decode) for _ in range(args.repeats)]
        print(json.dumps({"settings": ll.settings,
                          "ttft_s": statistics.median(r["ttft_s"] for r in runs),
                          "pp_tok_s": statistics.median(args.prompt_len / r["ttft_s"] for r in runs),
                          "tg_tok_s": statistics.median(r["decoded"] / r["decode_s"] for r in runs)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
