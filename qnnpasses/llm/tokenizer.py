"""The text side of a bundle: the tokenizer files that travel with it, its special ids, its chat template.

A Hugging Face folder (``save_pretrained``, Optimum's ``optimum-cli export onnx``) holds beside
the graph ``tokenizer.json`` (the ``tokenizers`` package's one-file tokenizer), and usually
``tokenizer_config.json`` (special tokens, often the chat template), ``chat_template.jinja``
(where transformers 5 writes the template), ``special_tokens_map.json``, ``config.json`` and
``generation_config.json`` (the ids ``generate()`` stops at).  :func:`find_tokenizer_dir` finds
them, :func:`copy_tokenizer` copies them into a bundle and returns what the manifest records,
:class:`TextTokenizer` encodes prompts, renders the chat template and decodes generated ids.

The chat template is rendered as transformers renders it (``apply_chat_template``): a sandboxed
Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the loop-controls extension, a
``tojson`` filter that does not escape HTML, ``raise_exception`` and ``strftime_now`` globals, the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables, then encoded without
adding special tokens (the template writes them itself).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

#: The one file a bundle needs for text: without it there is no tokenizer.
TOKENIZER_FILE = "tokenizer.json"
#: Copied beside it when present.
COMPANION_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json", "config.json")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """Missing or unusable tokenizer files; the message is one line for the user."""


def find_tokenizer_dir(model: str | Path, given: str | Path | None = None) -> Path | None:
    """The folder holding ``tokenizer.json``: ``given`` (TokenizerError when it has none), else the
    model's own folder when it has one, else None."""
    if given is not None:
        folder = Path(given)
        if not folder.is_dir():
            raise TokenizerError(f"--tokenizer-dir {given}: no such folder")
        if not (folder / TOKENIZER_FILE).is_file():
            raise TokenizerError(f"--tokenizer-dir {given}: the folder has no {TOKENIZER_FILE}")
        return folder
    folder = Path(model).parent
    return folder if (folder / TOKENIZER_FILE).is_file() else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path.name}: not readable JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class TextTokenizer:
    """A folder's tokenizer: encode, decode, chat template, special ids."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        path = self.folder / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(f"{self.folder}: no {TOKENIZER_FILE}")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the tokenizers package's message, on one line
            raise TokenizerError(f"{path.name}: the tokenizers package cannot read it: "
                                 f"{str(exc).strip().splitlines()[0][:200]}") from None
        self.config = _read_json(self.folder / "tokenizer_config.json")
        self.special_map = _read_json(self.folder / "special_tokens_map.json")
        self.generation = _read_json(self.folder / "generation_config.json")
        self.model_config = _read_json(self.folder / "config.json")
        self.chat_template = self._chat_template()

    # ------------------------------------------------------------------ special tokens

    def special_tokens(self) -> dict[str, str]:
        """``bos_token`` ... as strings, the template variables transformers passes."""
        found = {}
        for key in SPECIAL_TOKENS:
            text = _token_text(self.config.get(key)) or _token_text(self.special_map.get(key))
            if text is not None:
                found[key] = text
        return found

    def _id_of(self, key: str) -> int | None:
        text = self.special_tokens().get(key)
        return self.tokenizer.token_to_id(text) if text is not None else None

    def _first(self, key: str) -> list[int]:
        """``key``'s ids from generation_config.json, else config.json, else the tokenizer's token."""
        for source in (self.generation, self.model_config):
            if key in source and _ids(source[key]):
                return _ids(source[key])
        token = self._id_of(key.removesuffix("_id"))
        return [token] if token is not None else []

    @property
    def bos_token_id(self) -> int | None:
        ids = self._first("bos_token_id")
        return ids[0] if ids else None

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id generation stops at (``generate()`` takes a list; the tokenizer's own eos is added)."""
        ids = self._first("eos_token_id")
        own = self._id_of("eos_token")
        return sorted(set(ids + ([own] if own is not None else [])))

    @property
    def pad_token_id(self) -> int | None:
        ids = self._first("pad_token_id")
        return ids[0] if ids else None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def max_id(self) -> int:
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str) -> list[int]:
        """``text`` as the model's tokenizer encodes it by default (its post-processor adds BOS where it does)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @property
    def adds_bos(self) -> bool:
        """Whether encoding text puts the BOS token first (the post-processor's choice, e.g. LLaMA's
        tokenizers do, SmolLM2's and Qwen's do not)."""
        bos = self.bos_token_id
        return bos is not None and self.encode("a")[:1] == [bos]

    def _chat_template(self) -> str | None:
        jinja = self.folder / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        template = self.config.get("chat_template") or _read_json(self.folder / "chat_template.json").get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        return template if isinstance(template, str) else None

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template rendered the way transformers' ``apply_chat_template`` renders it."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.folder}: the tokenizer has no chat template (tokenizer_config.json "
                                 "'chat_template' or chat_template.jinja)")
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:
            from datetime import datetime

            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=None, documents=None,
                **self.special_tokens())
        except jinja2.exceptions.TemplateError as exc:
            raise TokenizerError(f"the chat template failed: {exc}") from None

    def encode_chat(self, user_text: str, system: str | None = None) -> list[int]:
        """A one-turn chat (an optional system message, the user's text, the assistant's turn opened)."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
        return list(self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids)

    def summary(self) -> dict[str, Any]:
        """What the manifest records."""
        return {"file": TOKENIZER_FILE, "vocab_size": self.vocab_size, "bos_token_id": self.bos_token_id,
                "eos_token_ids": self.eos_token_ids, "pad_token_id": self.pad_token_id,
                "adds_bos": self.adds_bos, "chat_template": self.chat_template is not None}


class StreamDecoder:
    """Decoded text of a growing id list, handed out piece by piece as it becomes final: a piece
    ending in an incomplete multi-byte character (decoded as U+FFFD) waits for the next id."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.sent = text[self.sent:], len(text)
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece, self.sent = text[self.sent:], len(text)
        return piece


def check_tokenizer(folder: Path, vocab: int) -> TextTokenizer:
    """``folder``'s tokenizer; TokenizerError when it knows ids the model has no logits for."""
    text = TextTokenizer(folder)
    if text.max_id() >= vocab:
        raise TokenizerError(f"the tokenizer in {folder} has token id {text.max_id()}, beyond the model's "
                             f"vocabulary of {vocab}: it belongs to another model")
    return text


def copy_tokenizer(folder: Path, out_dir: Path) -> dict[str, Any]:
    """Copy ``folder``'s tokenizer files into ``out_dir``; the manifest's ``tokenizer`` entry."""
    files = [TOKENIZER_FILE] + [name for name in COMPANION_FILES if (folder / name).is_file()]
    for name in files:
        shutil.copyfile(folder / name, out_dir / name)
    return {**TextTokenizer(folder).summary(), "files": files}
