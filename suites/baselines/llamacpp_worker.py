"""llama.cpp (through llama-cpp-python) as a JSON-lines worker: load a GGUF, greedy tokens, timings.

Run by path (`python suites/baselines/llamacpp_worker.py`), driven by suites/baselines/llamacpp.py.
Ops:
    info                                        versions, ggml system info (ISA flags it was built with)
    load   path, threads, n_ctx, n_batch,       RSS before/after, model bytes and parameters; repack
           repack                               false: llama.cpp's extra buffer types off (its weight
                                                repacking, AMX's among them: `--no-repack` of its CLI)
    greedy prompt (ids), n                      the n greedy tokens (argmax of the logits)
    time   prompt (ids), n_decode               ttft_s (prompt eval + first argmax), decode_s for
                                                n_decode more tokens, llama-bench style: a fresh
                                                context each call, one token per eval when decoding;
                                                by llama.cpp's own clock (llama_perf_context: the
                                                time inside llama_decode), and under "python" the
                                                same spans by this process's clock (the Python
                                                binding's per-token loop included)
    time_batch prompts (lists of ids), n_decode B sequences through llama.cpp's batch API: one
                                                llama_decode for every prompt (each its own sequence
                                                id), then n_decode steps of one llama_decode holding
                                                B tokens; ttft_s, decode_s, decoded = B · n_decode,
                                                tokens: each sequence's greedy tokens
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jsonl import serve  # noqa: E402
from llama_batch import check_prompt, check_prompts, decode_argmax, timed_decode  # noqa: E402

_state: dict = {}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def info() -> dict:
    import llama_cpp

    return {"llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


def load(path: str, threads: int, n_ctx: int = 4096, n_batch: int = 512, repack: bool = True) -> dict:
    import llama_cpp
    import llama_cpp.llama_cpp as api

    if not repack:  # the binding's Llama takes the model params from this function, with no switch of its own
        default = api.llama_model_default_params

        def no_repack():
            p = default()
            p.use_extra_bufts = False
            return p

        api.llama_model_default_params = no_repack
    before = _rss_bytes()
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                          n_threads_batch=threads, verbose=False, logits_all=False, use_mmap=False,
                          no_perf=False)
    _state["llm"] = llm
    _state["threads"] = threads
    return {"rss_before": before, "rss_after": _rss_bytes(),
            "model_bytes": int(llama_cpp.llama_model_size(llm.model)),
            "n_params": int(llama_cpp.llama_model_n_params(llm.model)),
            "n_vocab": int(llm.n_vocab()), "n_ctx": int(llm.n_ctx())}


def _llm():
    if "llm" not in _state:
        raise RuntimeError("no model loaded: call load first")
    return _state["llm"]


def _argmax_last(llm) -> int:
    """Greedy pick from the last evaluated position's logits (Llama.scores stays empty unless
    logits_all, which would copy every position's logits)."""
    import numpy as np

    ptr = llm._ctx.get_logits_ith(-1)
    return int(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).argmax())


def greedy(prompt: list, n: int) -> dict:
    check_prompt(prompt, n)
    llm = _llm()
    llm.reset()
    llm.eval(prompt)
    out = [_argmax_last(llm)]
    while len(out) < n:
        llm.eval([out[-1]])
        out.append(_argmax_last(llm))
    return {"tokens": out}


def _perf_reset(ctx) -> None:
    import llama_cpp

    llama_cpp.llama_perf_context_reset(ctx)


def _perf_seconds(ctx) -> float:
    """Seconds llama.cpp spent in llama_decode since the last reset, by its own timers (prompt-sized
    batches count under t_p_eval, single tokens under t_eval: both are decode work here)."""
    import llama_cpp

    d = llama_cpp.llama_perf_context(ctx)
    return (d.t_p_eval_ms + d.t_eval_ms) / 1e3


def time_run(prompt: list, n_decode: int) -> dict:
    check_prompt(prompt, n_decode)
    llm = _llm()
    ctx = llm._ctx.ctx
    llm.reset()
    _perf_reset(ctx)
    t0 = time.perf_counter()
    llm.eval(prompt)
    tok = _argmax_last(llm)
    t1 = time.perf_counter()
    native_ttft = _perf_seconds(ctx)
    _perf_reset(ctx)
    for _ in range(n_decode):
        llm.eval([tok])
        tok = _argmax_last(llm)
    t2 = time.perf_counter()
    return {"ttft_s": native_ttft, "decode_s": _perf_seconds(ctx), "decoded": n_decode, "rss": _rss_bytes(),
            "python": {"ttft_s": t1 - t0, "decode_s": t2 - t1}}


def _batch_context(n_seq: int, n_ctx: int, n_batch: int):
    """A second context on the loaded model for n_seq parallel sequences (kept until the shape changes)."""
    import llama_cpp

    key = (n_seq, n_ctx, n_batch)
    if _state.get("batch_key") != key:
        if _state.get("batch_ctx") is not None:
            llama_cpp.llama_free(_state.pop("batch_ctx"))
        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        p.n_threads = p.n_threads_batch = _state["threads"]
        p.no_perf = False  # llama.cpp's own timers (llama_perf_context) time the runs
        ctx = llama_cpp.llama_init_from_model(_llm().model, p)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {n_seq} sequences of {n_ctx} tokens")
        _state["batch_ctx"], _state["batch_key"] = ctx, key
    return _state["batch_ctx"]


def time_batch(prompts: list, n_decode: int) -> dict:
    import llama_cpp

    check_prompts(prompts, n_decode)
    b, n_prompt = len(prompts), sum(len(p) for p in prompts)
    per_seq = -(-(max(len(p) for p in prompts) + n_decode + 16) // 256) * 256
    ctx = _batch_context(b, b * per_seq, max(512, n_prompt))
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    n_vocab = _llm().n_vocab()
    batch = llama_cpp.llama_batch_init(max(n_prompt, b), 0, b)
    try:
        r = timed_decode(prompts, n_decode, lambda entries: decode_argmax(llama_cpp, ctx, batch, entries, n_vocab),
                         lambda: _perf_reset(ctx), lambda: _perf_seconds(ctx), n_batch=max(512, n_prompt))
    finally:
        llama_cpp.llama_batch_free(batch)
    return {**r, "rss": _rss_bytes()}


if __name__ == "__main__":
    sys.exit(serve({"info": info, "load": load, "greedy": greedy, "time": time_run, "time_batch": time_batch}))
