"""A byte-level tokenizer of our own: ids 0..255 are UTF-8 bytes, then specials.

No vocabulary file: every text round-trips exactly. Ids >= 256 that are not specials
(a random model may produce them) decode to nothing. Special ids: ``bos=256``,
``eos=257``. A model used with it needs ``vocab_size >= 258``.
"""

from __future__ import annotations

__all__ = ["ByteTokenizer", "chat_prompt"]


class ByteTokenizer:
    """UTF-8 bytes as tokens."""

    bos_id = 256
    eos_id = 257
    n_special = 2

    def __init__(self, vocab_size: int = 258) -> None:
        if vocab_size < 258:
            raise ValueError(f"vocab_size {vocab_size} < 258 (256 bytes + bos + eos)")
        self.vocab_size = vocab_size

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


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
