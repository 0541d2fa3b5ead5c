"""ik_llama.cpp as a JSON-lines worker: load a GGUF, greedy tokens, timings (same ops as llamacpp_worker).

Run by path with the build's directory (`python suites/baselines/ikllama_worker.py DIR`), driven by
suites/baselines/ikllama.py. DIR holds the `ik_llama_cpp` package of the ik-llama-cpp-python sdist
(its ctypes bindings of the fork's C API) with the library built from the same sdist in its lib/.
Ops:
    info                                        version, ggml system info (the ISA it was built with)
    load   path, threads, n_ctx, n_batch,       RSS before/after, model bytes and parameters; the
           mla, flash_attn, fused_moe, rtr      fork's settings (MLA mode, flash attention, fused
                                                MoE up/gate, run-time repack of the weights)
    greedy prompt (ids), n                      the n greedy tokens (argmax of the logits)
    time   prompt (ids), n_decode               ttft_s (prompt eval + first argmax), decode_s for
                                                n_decode more tokens, llama-bench style: a cleared
                                                cache each call, one token per llama_decode when
                                                decoding; by the fork's own clock (llama_get_timings:
                                                the time inside llama_decode), and under "python"
                                                the same spans by this process's clock (the ctypes
                                                per-token loop included)
    time_batch prompts (lists of ids), n_decode B sequences through the batch API: one llama_decode
                                                for every prompt (each its own sequence id), then
                                                n_decode steps of one llama_decode holding B tokens;
                                                ttft_s, decode_s, decoded = B · n_decode, tokens,
                                                flash_attn (off for B > 1: see _context)
"""
from __future__ import annotations

import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jsonl import serve  # noqa: E402
from llama_batch import check_prompt, check_prompts, decode_argmax, timed_decode  # noqa: E402

IK_DIR = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("MOETUNE_IK_DIR", "")
_state: dict = {}


def _api():
    """The sdist's ctypes bindings, loading the library built beside them (never another install)."""
    if "C" not in _state:
        lib = os.path.join(IK_DIR, "ik_llama_cpp", "lib", "libllama.so")
        if not os.path.isfile(lib):
            raise RuntimeError(f"no ik_llama.cpp build at {IK_DIR!r} (libllama.so missing)")
        os.environ["IK_LLAMA_CPP_LIB_PATH"] = lib
        sys.path.insert(0, IK_DIR)
        from ik_llama_cpp import _ctypes_api as C

        extra = {"llama_print_system_info": ([], ctypes.c_char_p),
                 "llama_model_size": ([ctypes.c_void_p], ctypes.c_uint64),
                 "llama_model_n_params": ([ctypes.c_void_p], ctypes.c_uint64),
                 "llama_n_ctx": ([ctypes.c_void_p], ctypes.c_uint32)}
        for name, (argtypes, restype) in extra.items():
            f = getattr(C._lib, name)
            f.argtypes, f.restype = argtypes, restype
        C.llama_backend_init()
        _state["C"] = C
    return _state["C"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def info() -> dict:
    C = _api()
    import ik_llama_cpp

    return {"ik_llama_cpp_python": ik_llama_cpp.__version__,
            "system_info": C._lib.llama_print_system_info().decode(errors="replace").strip()}


def _context(n_ctx: int, n_batch: int, n_seq: int):
    """A context with the loaded settings. Flash attention only for one sequence: with several
    sequences in one batch its CPU kernel aborts (GGML_ASSERT(S > 0), iqk/fa/iqk_fa_templates.h;
    seen on `small` and tiny-sized models alike), so batches of several run without it."""
    C, s = _api(), _state["settings"]
    p = C.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, n_batch, n_seq
    p.n_threads = p.n_threads_batch = s["threads"]
    p.flash_attn, p.mla_attn, p.fused_moe_up_gate = s["flash_attn"] and n_seq == 1, s["mla"], s["fused_moe"]
    ctx = C.llama_init_from_model(_state["model"], p)
    if not ctx:
        raise RuntimeError(f"ik_llama.cpp could not create a context for {n_seq} sequences of {n_ctx} tokens")
    return ctx


def load(path: str, threads: int, n_ctx: int = 4096, n_batch: int = 512, mla: int = 3, flash_attn: bool = True,
         fused_moe: bool = True, rtr: bool = True) -> dict:
    C = _api()
    if "model" in _state:
        raise RuntimeError("a model is loaded already (one per worker)")
    if not isinstance(threads, int) or threads < 1:
        raise ValueError("threads must be an integer ≥ 1")
    before = _rss_bytes()
    mp = C.llama_model_default_params()
    mp.mla, mp.flash_attn, mp.repack_tensors = mla, flash_attn, rtr
    mp.use_mmap = False  # read into memory, as the llama.cpp baseline does (and -rtr requires)
    model = C.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise RuntimeError(f"ik_llama.cpp could not load {path} (its log is on the worker's stderr)")
    _state["model"] = model
    _state["settings"] = {"threads": threads, "mla": mla, "flash_attn": flash_attn, "fused_moe": fused_moe}
    _state["ctx"], _state["n_batch"] = _context(n_ctx, n_batch, 1), n_batch
    _state["n_vocab"] = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
    return {"rss_before": before, "rss_after": _rss_bytes(),
            "model_bytes": int(C._lib.llama_model_size(model)), "n_params": int(C._lib.llama_model_n_params(model)),
            "n_vocab": int(_state["n_vocab"]), "n_ctx": int(C._lib.llama_n_ctx(_state["ctx"]))}


def _native_seconds(ctx) -> float:
    """Seconds spent in llama_decode since the last reset, by the fork's own timers (prompt-sized
    batches count under t_p_eval, single tokens under t_eval: both are decode work here)."""
    t = _api().llama_get_timings(ctx)
    return (t.t_p_eval_ms + t.t_eval_ms) / 1e3


def _timed(ctx, prompts: list, n_decode: int, n_batch: int) -> dict:
    """timed_decode on a cleared context, through a llama_batch of n_batch tokens."""
    C = _api()
    C.llama_kv_cache_clear(ctx)
    batch = C.llama_batch_init(max(n_batch, len(prompts)), 0, len(prompts))
    try:
        return timed_decode(prompts, n_decode, lambda entries: decode_argmax(C, ctx, batch, entries, _state["n_vocab"]),
                            lambda: C.llama_reset_timings(ctx), lambda: _native_seconds(ctx), n_batch)
    finally:
        C.llama_batch_free(batch)


def _loaded_ctx():
    if "ctx" not in _state:
        raise RuntimeError("no model loaded: call load first")
    return _state["ctx"]


def greedy(prompt: list, n: int) -> dict:
    check_prompt(prompt, n)
    return {"tokens": _timed(_loaded_ctx(), [prompt], n - 1, _state["n_batch"])["tokens"][0]}


def time_run(prompt: list, n_decode: int) -> dict:
    check_prompt(prompt, n_decode)
    r = _timed(_loaded_ctx(), [prompt], n_decode, _state["n_batch"])
    return {k: r[k] for k in ("ttft_s", "decode_s", "decoded", "python")} | {"rss": _rss_bytes()}


def time_batch(prompts: list, n_decode: int) -> dict:
    C = _api()
    check_prompts(prompts, n_decode)
    _loaded_ctx()
    b, n_prompt = len(prompts), sum(len(p) for p in prompts)
    per_seq = -(-(max(len(p) for p in prompts) + n_decode + 16) // 256) * 256
    key = (b, b * per_seq, max(512, n_prompt))
    if _state.get("batch_key") != key:  # a second context for B sequences, kept until the shape changes
        if _state.get("batch_ctx"):
            C.llama_free(_state.pop("batch_ctx"))
        _state["batch_ctx"], _state["batch_key"] = _context(key[1], key[2], b), key
    return {**_timed(_state["batch_ctx"], prompts, n_decode, key[2]), "rss": _rss_bytes(),
            "flash_attn": _state["settings"]["flash_attn"] and b == 1}


if __name__ == "__main__":
    sys.exit(serve({"info": info, "load": load, "greedy": greedy, "time": time_run, "time_batch": time_batch}))
