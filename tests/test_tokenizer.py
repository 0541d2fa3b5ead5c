"""Tests for engine.tokenizer: the preset BPE builder and the Tokenizer wrapper.

transformers' PreTrainedTokenizerFast is used only as an oracle here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import MoetuneError
from engine.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    USER_TOKEN,
    Tokenizer,
    build_preset_tokenizer,
    reserved_token,
)

VOCAB_SIZES = (512, 32000)

ROUND_TRIP = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve façade résumé Ångström über",
    "東京は晴れです。你好，世界！안녕하세요",
    "emoji: 🙂🚀👩‍💻🇫🇷 and ZWJ sequences",
    "    leading spaces",
    "trailing spaces    ",
    "tabs\tand\t\ttabs",
    "\n",
    "line one\nline two\r\nline three\n\n\n",
    "   \n \t \n   ",
    "def f(x):\n    return x ** 2  # square\n",
    "numbers 0 1 12 123 1234 3.14159 -2.5e-10 0xFF",
    "mixed <｜User｜> special <｜end▁of▁sentence｜> tokens",
    "lone surrogate-free but odd: \u00a0\u200b\ufeff\u2028",
    "Ωμέγα кириллица עברית العربية",
]


@pytest.fixture(scope="module")
def preset_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """One built preset tokenizer directory per vocab size (built once per module)."""
    dirs = {}
    for vocab_size in VOCAB_SIZES:
        out = tmp_path_factory.mktemp(f"tok{vocab_size}")
        build_preset_tokenizer(vocab_size, out)
        dirs[vocab_size] = out
    return dirs


@pytest.fixture(scope="module")
def toks(preset_dirs: dict[int, Path]) -> dict[int, Tokenizer]:
    """The loaded Tokenizer for each vocab size."""
    return {vs: Tokenizer.from_dir(d) for vs, d in preset_dirs.items()}


def _copy_preset(src: Path, dst: Path) -> Path:
    """Copy a built preset directory (so a test can edit its files)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(toks: dict[int, Tokenizer], vocab_size: int, text: str) -> None:
    tok = toks[vocab_size]
    ids = tok.encode(text, add_bos=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text)) == BOS_TOKEN + text


def test_empty_string(toks: dict[int, Tokenizer]) -> None:
    for tok in toks.values():
        assert tok.encode("", add_bos=False) == []
        assert tok.encode("") == [tok.bos_token_id]
        assert tok.decode([]) == ""


def test_corpus_round_trips_and_compresses(toks: dict[int, Tokenizer]) -> None:
    text = (Path(__file__).resolve().parents[1] / "engine" / "weights" / "corpus.txt").read_text(encoding="utf-8")
    tok = toks[32000]
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8")) / 3  # the merges were learnt from this text


# ---------------------------------------------------------------- build


def test_deterministic(preset_dirs: dict[int, Path], tmp_path: Path) -> None:
    for vocab_size, first in preset_dirs.items():
        again = tmp_path / str(vocab_size)
        build_preset_tokenizer(vocab_size, again)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert (again / name).read_bytes() == (first / name).read_bytes(), name


def test_build_is_deterministic_across_processes(preset_dirs: dict[int, Path], tmp_path: Path) -> None:
    """A fresh interpreter (different hash seed, parallelism allowed) gives the same bytes."""
    code = "import sys; from engine.tokenizer import build_preset_tokenizer as b; b(512, sys.argv[1])"
    repo = str(Path(__file__).resolve().parents[1])
    env = {"PYTHONHASHSEED": "12345", "TOKENIZERS_PARALLELISM": "true", "PYTHONPATH": repo}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env)
    assert (tmp_path / "tokenizer.json").read_bytes() == (preset_dirs[512] / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
def test_vocab_size_exact_and_contiguous(toks: dict[int, Tokenizer], vocab_size: int) -> None:
    tok = toks[vocab_size]
    assert tok.vocab_size == vocab_size
    vocab = tok._tok.get_vocab(with_added_tokens=True)
    assert sorted(vocab.values()) == list(range(vocab_size))


def test_small_vocab_has_no_reserved_tokens(toks: dict[int, Tokenizer]) -> None:
    tok = toks[512]
    assert tok.token_to_id(reserved_token(0)) is None
    assert tok._tok.get_vocab_size(with_added_tokens=False) == 512  # training hit the limit


def test_large_vocab_is_padded_with_reserved_tokens(toks: dict[int, Tokenizer]) -> None:
    tok = toks[32000]
    trained = tok._tok.get_vocab_size(with_added_tokens=False)
    assert 1000 < trained < 32000  # a few thousand merges, then padding
    n_reserved = 32000 - trained
    assert tok.token_to_id(reserved_token(0)) == trained
    assert tok.token_to_id(reserved_token(n_reserved - 1)) == 31999
    assert tok.token_to_id(reserved_token(n_reserved)) is None
    # reserved tokens are special: single ids, visible when decoded
    text = reserved_token(7)
    assert tok.encode(text, add_bos=False) == [trained + 7]
    assert tok.decode([trained + 7, 31999]) == reserved_token(7) + reserved_token(n_reserved - 1)


def test_too_small_vocab_rejected(tmp_path: Path) -> None:
    with pytest.raises(MoetuneError, match="too small"):
        build_preset_tokenizer(100, tmp_path)


def test_config_contents(preset_dirs: dict[int, Path]) -> None:
    config = json.loads((preset_dirs[512] / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["bos_token"] == BOS_TOKEN
    assert config["eos_token"] == EOS_TOKEN
    assert config["add_bos_token"] is True
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert isinstance(config["model_max_length"], int)
    assert "<｜User｜>" in config["chat_template"]


# ---------------------------------------------------------------- special tokens / bos


@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
def test_special_tokens_are_single_ids(toks: dict[int, Tokenizer], vocab_size: int) -> None:
    tok = toks[vocab_size]
    for expected_id, token in enumerate((BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)):
        assert tok.token_to_id(token) == expected_id
        assert tok.encode(token, add_bos=False) == [expected_id]
    assert tok.bos_token_id == 0
    assert tok.eos_token_id == 1
    ids = tok.encode(f"a{USER_TOKEN}b", add_bos=False)
    assert ids == tok.encode("a", add_bos=False) + [2] + tok.encode("b", add_bos=False)


def test_bos_added_by_default(toks: dict[int, Tokenizer]) -> None:
    tok = toks[512]
    ids = tok.encode("hello")
    assert ids[0] == tok.bos_token_id
    assert ids[1:] == tok.encode("hello", add_bos=False)
    assert tok.encode("hello", add_bos=True) == ids


def test_add_bos_token_false_in_config(preset_dirs: dict[int, Path], tmp_path: Path) -> None:
    d = _copy_preset(preset_dirs[512], tmp_path)
    config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["add_bos_token"] = False
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = Tokenizer.from_dir(d)
    assert tok.encode("hello")[0] != tok.bos_token_id
    assert tok.encode("hello", add_bos=True)[0] == tok.bos_token_id


def test_hf_dict_style_special_tokens(preset_dirs: dict[int, Path], tmp_path: Path) -> None:
    d = _copy_preset(preset_dirs[512], tmp_path)
    config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["bos_token"] = {"__type": "AddedToken", "content": BOS_TOKEN, "special": True}
    config["eos_token"] = {"content": EOS_TOKEN, "lstrip": False}
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = Tokenizer.from_dir(d)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)


def test_without_config(preset_dirs: dict[int, Path], tmp_path: Path) -> None:
    d = _copy_preset(preset_dirs[512], tmp_path)
    (d / "tokenizer_config.json").unlink()
    tok = Tokenizer.from_dir(d)
    assert tok.bos_token_id is None and tok.eos_token_id is None
    assert tok.encode("hi") == tok.encode("hi", add_bos=False)
    assert not tok.has_chat_template
    with pytest.raises(MoetuneError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------- chat template


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]


def test_chat_template(toks: dict[int, Tokenizer]) -> None:
    tok = toks[512]
    assert tok.has_chat_template
    expected = (
        f"{BOS_TOKEN}You are terse.{USER_TOKEN}Hi there{ASSISTANT_TOKEN}Hello.{EOS_TOKEN}"
        f"{USER_TOKEN}What is 2+2?"
    )
    assert tok.apply_chat_template(MESSAGES) == expected + ASSISTANT_TOKEN
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == expected
    no_system = tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert no_system == f"{BOS_TOKEN}{USER_TOKEN}x{ASSISTANT_TOKEN}"
    two_systems = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}]
    assert tok.apply_chat_template(two_systems, add_generation_prompt=False) == f"{BOS_TOKEN}A\n\nB"


def test_chat_template_encodes_with_special_ids(toks: dict[int, Tokenizer]) -> None:
    tok = toks[512]
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "x"}]), add_bos=False)
    assert ids[0] == 0 and ids[1] == 2 and ids[-1] == 3
    assert ids.count(0) == 1  # the template's bos, not a second one


def test_chat_template_bad_role(toks: dict[int, Tokenizer]) -> None:
    with pytest.raises(MoetuneError, match="unsupported chat role"):
        toks[512].apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_jinja_file_wins(preset_dirs: dict[int, Path], tmp_path: Path) -> None:
    d = _copy_preset(preset_dirs[512], tmp_path)
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}\n[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}", encoding="utf-8"
    )
    tok = Tokenizer.from_dir(d)
    assert tok.apply_chat_template(MESSAGES[1:3]) == "[user] Hi there\n[assistant] Hello.\n"


# ---------------------------------------------------------------- transformers oracle


@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
def test_matches_transformers(preset_dirs: dict[int, Path], toks: dict[int, Tokenizer], vocab_size: int) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(preset_dirs[vocab_size] / "tokenizer.json"))
    tok = toks[vocab_size]
    for text in ROUND_TRIP[1:8] + [f"{USER_TOKEN}hi{ASSISTANT_TOKEN}", "Weather at the river town in 1894."]:
        assert tok.encode(text) == hf.encode(text), text
        assert tok.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False), text
        ids = tok.encode(text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)
    assert len(hf) == vocab_size


def test_chat_template_matches_transformers(preset_dirs: dict[int, Path], toks: dict[int, Tokenizer]) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(preset_dirs[512]))
    assert (hf.bos_token_id, hf.eos_token_id) == (0, 1)
    for gen in (True, False):
        assert toks[512].apply_chat_template(MESSAGES, add_generation_prompt=gen) == hf.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=gen
        )


# ---------------------------------------------------------------- errors


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(MoetuneError, match="tokenizer.json") as info:
        Tokenizer.from_dir(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("content", ["{not json", "", '{"model": {"type": "Nope"}}', "[1, 2, 3]"])
def test_corrupt_tokenizer_json(tmp_path: Path, content: str) -> None:
    (tmp_path / "tokenizer.json").write_text(content, encoding="utf-8")
    with pytest.raises(MoetuneError, match="tokenizer.json") as info:
        Tokenizer.from_dir(tmp_path)
    assert "\n" not in str(info.value)


def test_corrupt_tokenizer_config(preset_dirs: dict[int, Path], tmp_path: Path) -> None:
    d = _copy_preset(preset_dirs[512], tmp_path)
    (d / "tokenizer_config.json").write_text("{oops", encoding="utf-8")
    with pytest.raises(MoetuneError, match="tokenizer_config.json"):
        Tokenizer.from_dir(d)


def test_bos_not_in_vocab(preset_dirs: dict[int, Path], tmp_path: Path) -> None:
    d = _copy_preset(preset_dirs[512], tmp_path)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}), encoding="utf-8")
    with pytest.raises(MoetuneError, match="not in tokenizer.json"):
        Tokenizer.from_dir(d)


def test_no_transformers_at_run_time() -> None:
    code = "import sys, engine.tokenizer; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
