"""One llama_decode of a filled llama_batch and the greedy pick of each output, for the GGUF workers.

Runs inside the worker processes (llamacpp_worker.py, ikllama_worker.py; imported by path beside
jsonl.py): `api` is the binding's module (llama_cpp, or ik_llama_cpp._ctypes_api: the fork keeps
llama.cpp's names for llama_decode and llama_get_logits_ith).
"""
from __future__ import annotations


def decode_argmax(api, ctx, batch, entries, n_vocab: int) -> list[int]:
    """entries: (token, position, sequence id, wants logits); the argmax of each output's logits."""
    import numpy as np

    batch.n_tokens = len(entries)
    for i, (tok, pos, seq, out) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
        batch.seq_id[i][0] = seq
    rc = api.llama_decode(ctx, batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")
    return [int(np.ctypeslib.as_array(api.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())
            for i, e in enumerate(entries) if e[3]]


def check_prompt(prompt, n) -> None:
    if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
        raise ValueError("prompt must be a non-empty list of token ids")
    if not isinstance(n, int) or n < 1:
        raise ValueError("the number of tokens must be an integer ≥ 1")


def check_prompts(prompts, n) -> None:
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for p in prompts:
        check_prompt(p, n)


def timed_decode(prompts: list[list[int]], n_decode: int, run, reset, seconds, n_batch: int) -> dict:
    """Every prompt (sequence s = its index) prefilled in llama_decode calls of up to n_batch tokens,
    then n_decode steps of one token per sequence, greedy. run(entries) → argmax of each output;
    reset() / seconds(): the engine's own timers (the time inside llama_decode). Returns ttft_s and
    decode_s by those timers, "python": the same spans by this process's clock, decoded, tokens
    (each sequence's n_decode + 1 greedy tokens)."""
    import time

    entries = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
    reset()
    t0 = time.perf_counter()
    toks: list[int] = []
    for i in range(0, len(entries), n_batch):
        toks += run(entries[i:i + n_batch])
    t1 = time.perf_counter()
    native_ttft = seconds()
    reset()
    out = [toks]
    for step in range(n_decode):
        toks = run([(toks[s], len(p) + step, s, True) for s, p in enumerate(prompts)])
        out.append(toks)
    t2 = time.perf_counter()
    return {"ttft_s": native_ttft, "decode_s": seconds(), "decoded": len(prompts) * n_decode,
            "tokens": [list(seq) for seq in zip(*out)], "python": {"ttft_s": t1 - t0, "decode_s": t2 - t1}}
