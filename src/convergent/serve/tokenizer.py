"""Tokenizers of the served checkpoint.

:func:`load_tokenizer` picks, as vLLM does, the checkpoint's own tokenizer: a
``tokenizer.json`` (read with the ``tokenizers`` library, the backend of transformers'
fast tokenizers) with the special tokens and chat template of ``tokenizer_config.json``
(or ``chat_template.jinja``), rendered by Jinja2 in a sandbox like transformers'
``apply_chat_template``. Only a checkpoint without a tokenizer gets the byte-level
:class:`ByteTokenizer` (ids 0..255 are UTF-8 bytes, ``bos=256``, ``eos=257``; every text
round-trips) and a plain chat format; one whose ``vocab_size`` is below 258 gets no
tokenizer at all (token-id prompts only). The returned note says which at start-up.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from convergent.core.errors import ConfigError

__all__ = ["ByteTokenizer", "HFTokenizer", "chat_prompt", "load_tokenizer"]


class ByteTokenizer:
    """UTF-8 bytes as tokens."""

    kind = "byte-level"
    bos_id = 256
    eos_id = 257
    n_special = 2
    has_chat_template = True

    def __init__(self, vocab_size: int = 258) -> None:
        if vocab_size < 258:
            raise ValueError(f"vocab_size {vocab_size} < 258 (256 bytes + bos + eos)")
        self.vocab_size = vocab_size
        self.eos_ids = [self.eos_id]

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_str(self, i: int) -> str:
        return self.decode([i])

    def render_chat(self, messages: list[dict]) -> tuple[str, bool]:
        """Prompt text and whether it already holds the BOS token (it does not)."""
        return chat_prompt(messages), False


def chat_prompt(messages: list[dict]) -> str:
    """Render chat messages as plain text: ``<|role|>\\ncontent\\n`` then ``<|assistant|>``."""
    parts = []
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):  # {"content": "<s>", ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


class HFTokenizer:
    """A checkpoint's ``tokenizer.json`` + ``tokenizer_config.json`` (+ chat template)."""

    kind = "checkpoint"

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        d = Path(model_dir)
        try:
            self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as exc:
            raise ConfigError(f"{d / 'tokenizer.json'}: cannot be read ({exc})") from None
        cfg: dict = {}
        if (d / "tokenizer_config.json").is_file():
            try:
                cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{d / 'tokenizer_config.json'}: not valid JSON ({exc})"
                ) from None
        self.special = {
            k: t
            for k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")
            if (t := _token_text(cfg.get(k))) is not None
        }
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.has_chat_template = self.chat_template is not None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        eos = self.special.get("eos_token")
        eid = self.tok.token_to_id(eos) if eos else None
        self.eos_ids = [] if eid is None else [eid]
        self._template = None

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids; ``bos``: add the special tokens of the tokenizer's post-processor
        (as transformers' ``encode(add_special_tokens=True)``)."""
        return self.tok.encode(text, add_special_tokens=bos).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def token_str(self, i: int) -> str:
        return self.tok.decode([i], skip_special_tokens=False)

    def render_chat(self, messages: list[dict]) -> tuple[str, bool]:
        """The chat template rendered with ``add_generation_prompt=True`` (transformers'
        ``apply_chat_template(..., tokenize=False)``); the text is then tokenized without
        adding special tokens again (the template writes them)."""
        if self.chat_template is None:
            raise ValueError("this checkpoint's tokenizer has no chat template")
        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                from jinja2.exceptions import TemplateError

                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
                x, ensure_ascii=False, indent=indent, sort_keys=kw.get("sort_keys", False)
            )
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        text = self._template.render(messages=messages, add_generation_prompt=True, **self.special)
        return text, True


def load_tokenizer(model_dir: str | Path, vocab_size: int) -> tuple[Any, str]:
    """``(tokenizer or None, one line saying which)`` for a checkpoint directory."""
    d = Path(model_dir)
    if (d / "tokenizer.json").is_file():
        tok = HFTokenizer(d)
        if tok.vocab_size > vocab_size:
            raise ConfigError(
                f"{d / 'tokenizer.json'}: {tok.vocab_size} tokens but the model's "
                f"vocab_size is {vocab_size}"
            )
        chat = "its chat template" if tok.has_chat_template else "no chat template"
        return tok, f"tokenizer: the checkpoint's tokenizer.json ({tok.vocab_size} tokens, {chat})"
    if (d / "tokenizer.model").is_file():
        raise ConfigError(
            f"{d}: tokenizer.model (SentencePiece) without tokenizer.json is not supported",
            hint="convert it once: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)",
        )
    if vocab_size >= 258:
        return ByteTokenizer(vocab_size), (
            f"tokenizer: {d} has none (no tokenizer.json); using the byte-level tokenizer "
            "(ids 0-255 = UTF-8 bytes, 256 = bos, 257 = eos) and a plain chat format"
        )
    return None, (
        f"tokenizer: {d} has none and vocab_size={vocab_size} < 258 leaves no room for "
        "the byte-level one: only token-id prompts are accepted"
    )
