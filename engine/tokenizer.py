"""Tokenizer: text <-> token ids, chat templates, and the preset tokenizer builder.

Run-time dependencies are only `tokenizers` (the Rust BPE) and `jinja2` (chat templates);
`transformers` is never imported here (it is a test-only oracle).

Two halves:

* `Tokenizer` loads a checkpoint directory the way Hugging Face lays it out:
  `tokenizer.json` (required), `tokenizer_config.json` (optional: bos/eos, add_bos_token,
  chat_template) and `chat_template.jinja` (optional, the newer place for the template).
* `build_preset_tokenizer` writes such a directory for the built-in random-weight presets:
  a byte-level BPE trained on the shipped corpus `engine/weights/corpus.txt`, with
  DeepSeek-V3's special tokens and a DeepSeek-V3-style chat template, padded with reserved
  special tokens to exactly the model's vocab size. Output is byte-identical across runs.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers

from engine.errors import MoetuneError

__all__ = [
    "IncrementalDecoder",
    "BOS_TOKEN",
    "EOS_TOKEN",
    "USER_TOKEN",
    "ASSISTANT_TOKEN",
    "PRESET_CHAT_TEMPLATE",
    "Tokenizer",
    "build_preset_tokenizer",
    "reserved_token",
]

# DeepSeek-V3 spelling: full-width vertical bars (U+FF5C) and lower one-eighth blocks (U+2581).
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)

CORPUS_PATH = Path(__file__).resolve().parent / "weights" / "corpus.txt"

# Minimum vocab: the special tokens plus the 256 byte-level symbols.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

# DeepSeek-V3-style template: bos, then every system message (joined by a blank line),
# then user turns as <｜User｜>content and assistant turns as <｜Assistant｜>content<eos>;
# the generation prompt is <｜Assistant｜>. Written without newlines so trim_blocks /
# lstrip_blocks cannot change its output.
PRESET_CHAT_TEMPLATE = (
    "{%- set ns = namespace(system_prompt='', first=true) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if ns.first -%}{%- set ns.system_prompt = message['content'] -%}"
    "{%- else -%}{%- set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] -%}"
    "{%- endif -%}"
    "{%- set ns.first = false -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{%- elif message['role'] != 'system' -%}"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<｜Assistant｜>' }}{%- endif -%}"
)


def reserved_token(n: int) -> str:
    """The n-th reserved padding token, e.g. `<｜reserved_0｜>`."""
    return f"<｜reserved_{n}｜>"


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def _one_line(err: BaseException) -> str:
    """`str(err)` squeezed onto one line (MoetuneError messages are printed as one line)."""
    return " ".join(str(err).split()) or type(err).__name__


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a plain string, an HF AddedToken dict
    (`{"content": ...}`), or null."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise MoetuneError(f"tokenizer_config.json: cannot read special token {value!r}")


def _pick_template(value: Any, source: Path) -> str | None:
    """The chat template from a config value: a string, or HF's list of
    `{"name": ..., "template": ...}` (the one named "default" wins, else the first)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(t, dict) for t in value):
        by_name = {t.get("name"): t.get("template") for t in value}
        chosen = by_name.get("default", value[0].get("template"))
        if isinstance(chosen, str):
            return chosen
    raise MoetuneError(f"{source}: chat_template is neither a string nor a list of named templates")


def _load_json_object(path: Path) -> dict[str, Any]:
    """Parse a JSON file that must hold an object; MoetuneError names the file otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MoetuneError(f"cannot read {path}: {_one_line(err)}") from None
    if not isinstance(data, dict):
        raise MoetuneError(f"cannot read {path}: expected a JSON object")
    return data


def _raise_exception(message: str) -> None:
    """Exposed to templates as `raise_exception(msg)`, as Hugging Face does."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    """Exposed to templates as the `tojson` filter, without HTML escaping (as HF does)."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox with HF's settings (trim_blocks, lstrip_blocks)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its chat template.

    Ids are ints in [0, vocab_size). `encode` never lets the tokenizer.json post-processor
    add special tokens; the bos is prepended here, under the control of `add_bos`.
    """

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        chat_template: str | None = None,
    ) -> None:
        """Wrap a loaded `tokenizers.Tokenizer`. bos/eos are token strings that must be in
        its vocab; `add_bos_token=None` means "add bos when there is one"."""
        self._tok = tok
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._bos_id = self._token_id(bos_token)
        self._eos_id = self._token_id(eos_token)
        self.add_bos_token = (self._bos_id is not None) if add_bos_token is None else bool(add_bos_token)
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None

    def _token_id(self, token: str | None) -> int | None:
        """Id of a special token string, None for None; MoetuneError if not in the vocab."""
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise MoetuneError(f"special token {token!r} from tokenizer_config.json is not in tokenizer.json")
        return token_id

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load `tokenizer.json` (required) and, if present, `tokenizer_config.json` and
        `chat_template.jinja` (which takes precedence over the config's chat_template)."""
        directory = Path(path)
        tok_path = directory / "tokenizer.json"
        if not tok_path.is_file():
            raise MoetuneError(f"no tokenizer: {tok_path} does not exist")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as err:  # the Rust side raises a bare Exception for any parse error
            raise MoetuneError(f"cannot load tokenizer {tok_path}: {_one_line(err)}") from None

        config_path = directory / "tokenizer_config.json"
        config = _load_json_object(config_path) if config_path.is_file() else {}
        template = _pick_template(config.get("chat_template"), config_path)
        jinja_path = directory / "chat_template.jinja"
        if jinja_path.is_file():
            try:
                template = jinja_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise MoetuneError(f"cannot read {jinja_path}: {_one_line(err)}") from None
        add_bos = config.get("add_bos_token")
        return cls(
            tok,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            add_bos_token=None if add_bos is None else bool(add_bos),
            chat_template=template,
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added (special/reserved) tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, None if the checkpoint has none."""
        return self._bos_id

    @property
    def eos_token_id(self) -> int | None:
        """Id of the end-of-sequence token, None if the checkpoint has none."""
        return self._eos_id

    def token_to_id(self, token: str) -> int | None:
        """Id of one token string (special tokens included), None if unknown."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. Special-token strings inside `text` become their single ids.

        add_bos: prepend the bos id; None follows tokenizer_config's add_bos_token (default:
        True when a bos exists). Ignored when the tokenizer has no bos.
        """
        ids = self._tok.encode(text, add_special_tokens=False).ids
        want_bos = self.add_bos_token if add_bos is None else add_bos
        if want_bos and self._bos_id is not None:
            ids = [self._bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens kept visible (bos, reserved tokens, ... appear as text)."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        """Whether the checkpoint ships a chat template."""
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render `messages` (dicts with "role" and "content") with the checkpoint's Jinja
        template; the result is text, to be passed to `encode(..., add_bos=False)` since
        templates normally emit the bos themselves."""
        if not self.chat_template:
            raise MoetuneError("this checkpoint has no chat template (tokenizer_config.json has no chat_template)")
        try:
            if self._template is None:
                self._template = _compile_template(self.chat_template)
            context: dict[str, Any] = {"messages": messages, "add_generation_prompt": add_generation_prompt}
            if self.bos_token is not None:
                context["bos_token"] = self.bos_token
            if self.eos_token is not None:
                context["eos_token"] = self.eos_token
            return self._template.render(**context)
        except jinja2.exceptions.TemplateError as err:
            raise MoetuneError(f"chat template failed: {_one_line(err)}") from None


class IncrementalDecoder:
    """`decode(ids)` of a growing token list, kept up to date at a bounded cost per new token.

    Decoding a request's whole output after every token costs O(n²) over the request. Here the
    text is `committed` (the text of ids[:read], never decoded again) plus the tail: the text of
    ids[read:], found by decoding a short window ids[prefix:] and dropping the text of its context
    ids[prefix:read] (so decoders that look at the previous token, like SentencePiece's leading
    space, still see it). The tail is committed once it ends in a whole character. A tail ending
    in U+FFFD may be an unfinished UTF-8 character (byte-level BPE splits characters across
    tokens), which later tokens complete; it stays in the window, and `text` shows it as `decode`
    does, replacement character included. A window that keeps ending in U+FFFD (runs of stray
    bytes) is cut behind its last BYTE_LOOKAHEAD tokens when the cut provably changes nothing: a
    UTF-8 character spans at most 4 bytes and a token holds at least one.

    `update(ids)` takes the whole list each time (it may be the same list again, or one token
    shorter than it will grow to: the engine drops a final EOS); `ids` must only grow.
    """

    BYTE_LOOKAHEAD = 3
    MAX_WINDOW = 8  # uncommitted tokens before a cut behind the last BYTE_LOOKAHEAD is tried

    def __init__(self, decode) -> None:
        self._decode = decode
        self.committed = ""  # text of ids[:read]
        self.prefix = 0  # the window's context starts here
        self.read = 0  # ids[:read] are in `committed`
        self._context = ""  # decode(ids[prefix:read])
        self.text = ""
        self.changed_from = 0  # the last update may have changed text from this index on

    def update(self, ids: list[int]) -> str:
        """The text of `ids` (equal to decode(ids)); also sets `changed_from`: text before it is
        unchanged since the previous update."""
        self.changed_from = len(self.committed)
        full = self._decode(ids[self.prefix:])
        if not full.startswith(self._context):  # a decoder this scheme does not fit: decode all
            self.changed_from = 0
            self.committed, self.prefix, self.read, self._context = "", 0, 0, ""
            full = self._decode(ids)
        tail = full[len(self._context):]
        if tail and not tail.endswith("\ufffd"):
            self._commit(ids, len(ids), tail)
            tail = ""
        elif len(ids) - self.read > self.MAX_WINDOW:
            tail = self._cut(ids, tail)
        self.text = self.committed + tail
        return self.text

    def _commit(self, ids: list[int], upto: int, text: str) -> None:
        self.committed += text
        self.prefix, self.read = self.read, upto
        self._context = self._decode(ids[self.prefix:self.read])

    def _cut(self, ids: list[int], tail: str) -> str:
        """Commit ids[read:cut], cut leaving BYTE_LOOKAHEAD tokens after it, if the text does not
        change by it (a character left unfinished at the cut would); returns the tail left."""
        saved = (self.committed, self.prefix, self.read, self._context)
        cut = len(ids) - self.BYTE_LOOKAHEAD
        head = self._decode(ids[self.prefix:cut])
        if head.startswith(self._context):
            head = head[len(self._context):]
            self._commit(ids, cut, head)
            full = self._decode(ids[self.prefix:])
            if full.startswith(self._context) and head + full[len(self._context):] == tail:
                return full[len(self._context):]
        self.committed, self.prefix, self.read, self._context = saved
        return tail


# --------------------------------------------------------------------------------------
# Building the preset tokenizer
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _single_threaded() -> Iterator[None]:
    """Run the `tokenizers` trainer without its rayon thread pool (read at call time), so
    the word counts are accumulated in one fixed order, then restore the environment."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def _corpus_lines() -> list[str]:
    """The shipped training corpus as lines, newlines kept (so "\\n" tokens are learnt)."""
    try:
        return CORPUS_PATH.read_text(encoding="utf-8").splitlines(keepends=True)
    except OSError as err:
        raise MoetuneError(f"cannot read the preset tokenizer corpus {CORPUS_PATH}: {_one_line(err)}") from None


def _train_bpe(vocab_size: int) -> tokenizers.Tokenizer:
    """Byte-level BPE trained on the corpus with at most `vocab_size` entries.

    Ids 0-3 are the DeepSeek special tokens, then the 256 byte symbols, then merges.
    Merges need a pair seen at least twice, so training can stop below vocab_size.
    """
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with _single_threaded():
        tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    return tok


def _pad_with_reserved(tok: tokenizers.Tokenizer, vocab_size: int) -> int:
    """Add `<｜reserved_N｜>` special tokens until the vocab has exactly `vocab_size` ids.

    Returns the number added (0 when training already filled the vocab).
    """
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([AddedToken(reserved_token(n), special=True, normalized=False) for n in range(missing)])
    return max(missing, 0)


def _preset_config(model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json for the preset (HF fields, DeepSeek-V3 values)."""
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": None,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": PRESET_CHAT_TEMPLATE,
    }


def build_preset_tokenizer(vocab_size: int, out_dir: str | os.PathLike[str], *, model_max_length: int = 4096) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` for a random-weight preset.

    The tokenizer is a byte-level BPE (every string round-trips) trained on the shipped
    corpus, with DeepSeek-V3's special tokens (ids 0-3: bos, eos, <｜User｜>, <｜Assistant｜>)
    and exactly `vocab_size` ids in all: when training stops short, the rest are reserved
    special tokens `<｜reserved_N｜>`. The post-processor prepends bos (as DeepSeek-V3's
    does), so HF's PreTrainedTokenizerFast encodes like `Tokenizer.encode`. Deterministic:
    the same arguments always give byte-identical files.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise MoetuneError(
            f"preset vocab_size {vocab_size} is too small: a byte-level tokenizer needs >= {MIN_VOCAB_SIZE}"
        )
    tok = _train_bpe(vocab_size)
    _pad_with_reserved(tok, vocab_size)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A:0",
        pair=f"{BOS_TOKEN} $A:0 {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, tok.token_to_id(BOS_TOKEN))],
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config_text = json.dumps(_preset_config(model_max_length), ensure_ascii=False, indent=2)
    (out / "tokenizer_config.json").write_text(config_text + "\n", encoding="utf-8")
