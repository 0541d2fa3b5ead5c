"""Incremental detokenization (engine.tokenizer.IncrementalDecoder) and the engine's per-token text
and stop handling (LLM._accept): at every step the text equals decoding the whole output, and stop
strings, EOS and max_tokens end a request exactly where the whole-decode rule (the reference below,
the engine's rule before it went incremental) ends it.

Byte-level BPE splits multi-byte characters across tokens ("€" is three byte tokens in the tiny
preset), so texts pass through states ending in U+FFFD; scripted token streams cover those, stop
strings straddling tokens, EOS, special tokens and long random outputs.
"""
from __future__ import annotations

import random

import pytest
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine import LLM, SamplingParams
from engine.llm import RequestOutput
from engine.scheduler import Request
from engine.tokenizer import IncrementalDecoder, Tokenizer, build_preset_tokenizer

VOCAB = 512


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tok")
    build_preset_tokenizer(VOCAB, out)
    return Tokenizer.from_dir(out)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", dtype="float32", progress=False)


def stepwise(decode, ids: list[int]) -> list[str]:
    d = IncrementalDecoder(decode)
    return [d.update(ids[:k]) for k in range(1, len(ids) + 1)]


def wholes(decode, ids: list[int]) -> list[str]:
    return [decode(ids[:k]) for k in range(1, len(ids) + 1)]


# ---------------------------------------------------------------- the decoder alone


def test_split_utf8_characters(tok):
    text = "prix: 5€, café, 日本, 😀!"
    ids = tok.encode(text, add_bos=False)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # some characters really are split
    got = stepwise(tok.decode, ids)
    assert got == wholes(tok.decode, ids)
    assert got[-1] == text
    assert any(t.endswith("\ufffd") for t in got)  # unfinished characters show as decode shows them


def test_same_list_again_and_one_shorter(tok):
    """The engine passes the same list again after EOS (the output less its final EOS)."""
    ids = tok.encode("a€b", add_bos=False)
    d = IncrementalDecoder(tok.decode)
    for k in range(1, len(ids) + 1):
        d.update(ids[:k])
    assert d.update(ids) == "a€b" and d.update(ids) == "a€b"


@pytest.mark.parametrize("seed", range(4))
def test_long_random_outputs_equal_whole_decode(tok, seed):
    """Random ids over the whole vocabulary (stray UTF-8 bytes, special tokens, merges): every
    step's text equals decode of the prefix, and the work per token stays bounded (the window
    that is decoded again never grows with the output)."""
    g = random.Random(seed)
    ids = [g.randrange(VOCAB) for _ in range(1500)]
    calls = []

    def counting(x):
        calls.append(len(x))
        return tok.decode(x)

    d = IncrementalDecoder(counting)
    for k in range(1, len(ids) + 1):
        assert d.update(ids[:k]) == tok.decode(ids[:k]), f"step {k}"
    assert max(calls) <= 20  # tokens decoded at once, whatever the length
    assert len(calls) <= 4 * len(ids)


def test_runs_of_stray_bytes_stay_bounded(tok):
    """Continuation bytes alone decode to U+FFFD each, so the tail always ends in one: the cut
    behind the last tokens still commits them and the text stays exact."""
    cont = [i for i in range(VOCAB) if tok.decode([i]) == "\ufffd" and tok.decode([i, i]) == "\ufffd\ufffd"]
    lead3 = tok.encode("€", add_bos=False)[0]
    ids = ([cont[0]] * 50 + [lead3] + [cont[1]] * 30) * 3
    calls = []

    def counting(x):
        calls.append(len(x))
        return tok.decode(x)

    assert stepwise(counting, ids) == wholes(tok.decode, ids)
    assert max(calls) <= 20  # tokens decoded at once, whatever the length


def test_context_dependent_decoder():
    """A SentencePiece-style decoder (Metaspace: the first token's leading space is dropped) needs
    the previous tokens as context: the text still equals the whole decode at every step."""
    t = tokenizers.Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    t.train_from_iterator(["the cat sat on the mat", "a dog and a cat"] * 20,
                          trainers.BpeTrainer(vocab_size=60, show_progress=False))
    ids = t.encode("the cat and the dog sat on a mat").ids * 3

    def decode(x):
        return t.decode(x)

    assert stepwise(decode, ids) == wholes(decode, ids)


def test_decoder_that_breaks_the_window_falls_back_to_whole_decode():
    """A decode whose text of a window is not a prefix-extension of its context's (here: digits
    summed) is detected, and the whole list is decoded instead."""
    def decode(x):
        return str(sum(x))

    ids = [3, 9, 1, 7, 7, 2, 8] * 4
    assert stepwise(decode, ids) == wholes(decode, ids)


# ---------------------------------------------------------------- the engine's text and stops


def reference_accept(decode, eos_id, token_ids: list[int], params: SamplingParams) -> tuple[str, str | None]:
    """The engine's rule before incremental detokenization: decode everything every token."""
    eos = token_ids[-1] == eos_id and not params.ignore_eos
    text = decode(token_ids[:-1] if eos else token_ids)
    stop = next((s for s in params.stop_strings if s in text), None)
    if stop is not None:
        return text[: text.index(stop)], "stop"
    if eos:
        return text, "stop"
    if len(token_ids) >= params.max_tokens:
        return text, "length"
    return text, None


def scripted(llm: LLM, script: list[int], params: SamplingParams) -> list[tuple[str, str | None]]:
    """Feed `script` through LLM._accept (a sampler that replays it); (text, finish) per step."""
    it = iter(script)
    req = Request(RequestOutput([5, 6]), params, sampler=lambda logits: next(it))
    seen = []
    while req.out.finish_reason is None and len(seen) < len(script):
        llm._accept(req, torch.zeros(VOCAB))
        seen.append((req.out.text, req.out.finish_reason))
    return seen


def expected(llm: LLM, script: list[int], params: SamplingParams) -> list[tuple[str, str | None]]:
    out = []
    for k in range(1, len(script) + 1):
        out.append(reference_accept(llm.tokenizer.decode, llm.eos_token_id, script[:k], params))
        if out[-1][1] is not None:
            break
    return out


def test_stop_string_across_tokens_and_split_characters(llm):
    t = llm.tokenizer
    script = t.encode("total: 5€ and 7€ then stop here", add_bos=False)
    for stop in ["€ and", "5€", "then st", "stop here", "e", "xyz", "€ then"]:
        params = SamplingParams(max_tokens=100, stop=["\x00never", stop])
        got = scripted(llm, script, params)
        assert got == expected(llm, script, params), stop
    # "€ and" straddles tokens and starts inside a split character: it ends the text before the €
    got = scripted(llm, script, SamplingParams(max_tokens=100, stop="€ and"))
    assert got[-1] == ("total: 5", "stop")


def test_eos_and_max_tokens(llm):
    t = llm.tokenizer
    body = t.encode("ab€c", add_bos=False)
    for params in (SamplingParams(max_tokens=100), SamplingParams(max_tokens=100, ignore_eos=True),
                   SamplingParams(max_tokens=3), SamplingParams(max_tokens=100, stop="c")):
        script = body[:2] + [llm.eos_token_id] + body[2:] + [llm.eos_token_id]
        assert scripted(llm, script, params) == expected(llm, script, params)
    script = body[:3] + [llm.eos_token_id]  # EOS right after the first byte of "€"
    params = SamplingParams(max_tokens=100)
    assert scripted(llm, script, params) == expected(llm, script, params)


def test_empty_stop_string_stops_at_once(llm):
    script = llm.tokenizer.encode("hello", add_bos=False)
    params = SamplingParams(max_tokens=100, stop=[""])
    assert scripted(llm, script, params) == expected(llm, script, params) == [("", "stop")]


@pytest.mark.parametrize("seed", range(3))
def test_long_random_outputs_match_the_whole_decode_rule(llm, seed):
    """600 random tokens (EOS ignored), stop strings picked from the output's own text at token
    boundaries and inside tokens: text and finish equal the reference at every step."""
    g = random.Random(100 + seed)
    script = [g.randrange(VOCAB) for _ in range(600)]
    full = llm.tokenizer.decode(script)
    clean = [k for k in range(len(full) - 4) if "\ufffd" not in full[k:k + 4]]
    for _ in range(3):
        k = clean[g.randrange(len(clean) // 2, len(clean))]
        params = SamplingParams(max_tokens=600, ignore_eos=True, stop=[full[k:k + 4], full[k + 1:k + 3]])
        assert scripted(llm, script, params) == expected(llm, script, params)
    params = SamplingParams(max_tokens=600, ignore_eos=True)
    got = scripted(llm, script, params)
    assert got == expected(llm, script, params) and got[-1] == (full, "length")


def test_generate_text_equals_decode_of_tokens(llm):
    outs = llm.generate(["hello world", "prix €"], SamplingParams(max_tokens=24, ignore_eos=True))
    for o in outs:
        assert o.text == llm.tokenizer.decode(o.token_ids)
