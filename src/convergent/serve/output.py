"""One choice's output as the client sees it: incremental text, stop strings, logprobs.

The engine produces token ids; :class:`ChoiceOutput` turns them into text deltas (holding
back an incomplete UTF-8 sequence, and the tail that could still become a stop string),
ends the choice at the first stop string (the text stops before it, as OpenAI's does) and
builds the OpenAI logprob records. With the completions API's ``echo`` the prompt's text
comes first, and its tokens (first logprob ``None``) lead the logprob arrays; with
``max_tokens: 0`` the one token the engine samples is not shown.
"""

from __future__ import annotations

from typing import Any

from convergent.serve.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)
from convergent.serve.sampling import TokenLogprobs
from convergent.serve.scheduler_base import Request

__all__ = ["ChoiceOutput"]


class ChoiceOutput:
    """Accumulates one engine request's tokens (``tok`` decodes; may be ``None``)."""

    def __init__(
        self,
        index: int,
        req: Request,
        tok: Any,
        stops: list[str],
        echo: str | None = None,
        show_tokens: bool = True,
    ) -> None:
        self.index, self.req, self.tok = index, req, tok
        self.echo = echo  # the prompt's text, shown before the completion (``echo``)
        self.show_tokens = show_tokens  # false: max_tokens 0 (the prompt only)
        self.stop_ids = req.stop_ids
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""  # the full text so far (cut at a stop string once found)
        self.sent = 0  # characters of ``text`` already sent
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.lp_sent = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def full_text(self) -> str:
        """The choice's whole text: the echoed prompt (if any), then the completion."""
        return (self.echo or "") + self.text

    def add(self, token: int, finished: bool, reason: str | None) -> tuple[str, bool]:
        """Apply one engine event; returns ``(text delta, stop string hit)``."""
        if self.done:
            return "", False
        if token >= 0 and self.show_tokens:
            self.tokens.append(token)
        shown = self.tokens
        if finished and reason == "stop" and shown and shown[-1] in self.stop_ids:
            shown = shown[:-1]  # a stop token's text is not part of the output (as vLLM)
        full = self.tok.decode(shown) if self.tok is not None else ""
        cut = min((i for s in self.stops if (i := full.find(s)) >= 0), default=-1)
        hit = cut >= 0
        if hit:
            full = full[:cut]
        self.text = full
        if hit:
            self.finish_reason = "stop"
        elif finished:
            self.finish_reason = reason or "stop"
            if reason == "error":
                self.error = self.req.error or "the engine failed"
        if self.done:
            safe = len(full)
        else:
            safe = len(full) - self.hold
            while safe > 0 and full[safe - 1] == "\ufffd":  # incomplete UTF-8: wait
                safe -= 1
        delta = full[self.sent : max(self.sent, safe)]
        self.sent = max(self.sent, safe)
        return delta, hit

    # -- logprobs
    def _entries(self, start: int) -> list[tuple[int, TokenLogprobs]]:
        """``(token, its logprobs)`` of the output tokens from ``start`` that have them."""
        lps = self.req.token_logprobs
        n = min(len(self.tokens), len(lps))
        return [(self.tokens[i], e) for i in range(start, n) if (e := lps[i]) is not None]

    def _s(self, i: int) -> str:
        return self.tok.token_str(i) if self.tok is not None else str(i)

    def chat_logprobs(self, new_only: bool = False) -> ChatLogprobs | None:
        if self.req.sampling.logprobs < 0:
            return None
        start = self.lp_sent if new_only else 0
        items = self._entries(start)
        self.lp_sent = start + len(items)
        out = []
        for t, e in items:
            s = self._s(t)
            tops = [
                TopLogprob(token=self._s(i), logprob=v, bytes=list(self._s(i).encode()))
                for i, v in e.top.items()
            ]
            out.append(
                TokenLogprob(token=s, logprob=e.logprob, bytes=list(s.encode()), top_logprobs=tops)
            )
        return ChatLogprobs(content=out)

    def completion_logprobs(
        self, new_only: bool = False, offset0: int = 0
    ) -> CompletionLogprobs | None:
        if self.req.sampling.logprobs < 0:
            return None
        start = self.lp_sent if new_only else 0
        items = self._entries(start)
        self.lp_sent = start + len(items)
        toks: list[str] = []
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offs: list[int] = []
        off = offset0
        if self.echo is not None and not new_only:
            off = self._prompt_logprobs(toks, lps, tops, offs, off)
        for t, e in items:
            s = self._s(t)
            toks.append(s)
            lps.append(e.logprob)
            tops.append(self._top(e))
            offs.append(off)
            off += len(s)
        return CompletionLogprobs(
            tokens=toks, token_logprobs=lps, top_logprobs=tops, text_offset=offs
        )

    def _prompt_logprobs(self, toks: list, lps: list, tops: list, offs: list, off: int) -> int:
        """Append the echoed prompt's tokens and logprobs (the first's is ``None``) to the
        completion's logprob columns; returns the text offset after them."""
        entries = self.req.prompt_logprobs
        for i, t in enumerate(self.req.prompt):
            s = self._s(t)
            e = entries[i] if i < len(entries) else None
            toks.append(s)
            lps.append(None if e is None else e.logprob)
            tops.append(None if e is None else self._top(e))
            offs.append(off)
            off += len(s)
        return off

    def _top(self, e: TokenLogprobs) -> dict[str, float]:
        d: dict[str, float] = {}
        for i, v in e.top.items():  # ids that decode alike share a key: keep the likelier
            d.setdefault(self._s(i), v)
        return d
