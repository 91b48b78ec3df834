"""From a validated OpenAI request to engine requests (the API's input side).

:func:`build_requests` tokenizes the prompt(s) (or renders the chat with the checkpoint's
chat template), checks them against the vocabulary and the context limit, and makes one
engine :class:`~convergent.serve.scheduler_base.Request` per prompt and choice (``n``),
each with a :class:`~convergent.serve.output.ChoiceOutput` that turns its tokens back
into text (after the prompt's, with ``echo``; ``max_tokens: 0`` runs one token that is not
shown, so the prefill computes the prompt's logprobs). Problems raise :class:`~convergent.serve.protocol.RequestError` (a 400 naming
the field).
"""

from __future__ import annotations

from typing import Any

from convergent.serve.engine import Engine
from convergent.serve.output import ChoiceOutput
from convergent.serve.predictor import LengthPredictor
from convergent.serve.protocol import ChatCompletionRequest, CompletionRequest, RequestError, Usage
from convergent.serve.scheduler_base import Request

__all__ = ["build_requests", "error_response", "prompt_ids", "usage_of"]


def error_response(
    status: int, message: str, code: str, etype: str = "invalid_request_error", param=None
):
    """An OpenAI-style error body with its HTTP status."""
    from fastapi.responses import JSONResponse

    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": etype, "param": param, "code": code}},
    )


def prompt_ids(body, chat: bool, tok: Any, vocab: int) -> list[list[int]]:
    """Token ids of each prompt of a completion request, or of the rendered chat."""
    if chat:
        if tok is None:
            raise RequestError(
                "messages: this checkpoint has no tokenizer (token-id prompts only)", "messages"
            )
        if not tok.has_chat_template:
            raise RequestError(
                "messages: this checkpoint's tokenizer has no chat template", "messages"
            )
        try:
            text, has_bos = tok.render_chat([m.as_template_dict() for m in body.messages])
        except Exception as exc:
            raise RequestError(f"messages: the chat template failed: {exc}", "messages") from None
        return [tok.encode(text, bos=not has_bos)]
    p = body.prompt
    items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    out = []
    for it in items:
        if isinstance(it, str):
            if tok is None:
                raise RequestError(
                    "prompt: this checkpoint has no tokenizer; send token ids (a list of ints)",
                    "prompt",
                )
            out.append(tok.encode(it))
        else:
            bad = [i for i in it if i >= vocab]
            if bad:
                raise RequestError(f"prompt: token id {bad[0]} >= vocab_size {vocab}", "prompt")
            out.append(list(it))
    return out


def build_requests(
    engine: Engine,
    body: CompletionRequest | ChatCompletionRequest,
    chat: bool,
    tok: Any,
    predictor: LengthPredictor | None,
    default_max_tokens: int,
) -> tuple[list[Request], list[ChoiceOutput]]:
    """Engine requests (not yet added) and their choice outputs, prompt-major, ``n`` each;
    choice ``j`` samples with ``body.sampling_params(j)``; without ``max_tokens``, up to
    ``default_max_tokens`` (``serve.http.default_max_tokens``) within the context."""
    vocab = engine.vocab_size
    prompts = prompt_ids(body, chat, tok, vocab)
    mt = getattr(body, "max_completion_tokens", None) or body.max_tokens
    limit = engine.context_limit
    bad = [i for i in body.stop_token_ids or [] if i >= vocab]
    if bad:
        raise RequestError(f"stop_token_ids: {bad[0]} >= vocab_size {vocab}", "stop_token_ids")
    echo = bool(getattr(body, "echo", False))
    if (body.stop_strings or body.logprobs or echo) and tok is None:
        param = "stop" if body.stop_strings else "logprobs" if body.logprobs else "echo"
        raise RequestError(f"{param}: needs a tokenizer, and this checkpoint has none", param)
    eos = [] if body.ignore_eos else list(tok.eos_ids if tok is not None else [])
    reqs, outs = [], []
    for i, p_ids in enumerate(prompts):
        max_tokens = (
            mt if mt is not None else max(1, min(default_max_tokens, limit - len(p_ids)))
        )
        show = max_tokens > 0
        max_tokens = max(1, max_tokens)  # 0 (echo): the prefill and one token not shown
        why = engine.context_error(len(p_ids), max_tokens)
        if why is not None:
            raise RequestError(why, "messages" if chat else "prompt", "context_length_exceeded")
        pred = None
        if predictor is not None and tok is not None:
            pred = min(predictor.predict(tok.decode(p_ids)), max_tokens)
        for j in range(body.n):
            r = engine.make_request(
                p_ids,
                max_tokens,
                pred,
                body.sampling_params(j),
                stop_ids=[] if body.ignore_eos else None,
                extra_stop_ids=[*(body.stop_token_ids or []), *eos],
            )
            reqs.append(r)
            text = _echo_text(body, i, p_ids, tok) if echo else None
            outs.append(ChoiceOutput(len(outs), r, tok, body.stop_strings, text, show))
    return reqs, outs


def _echo_text(body: CompletionRequest, i: int, ids: list[int], tok: Any) -> str:
    """The text echoed for prompt ``i``: as sent, or the token ids decoded."""
    p = body.prompt
    text = p if isinstance(p, str) else p[i] if isinstance(p[0], str) else None
    return text if isinstance(text, str) else tok.decode(ids)


def usage_of(reqs: list[Request], outs: list[ChoiceOutput]) -> Usage:
    """Prompt, completion and total tokens of a request's choices."""
    pt = sum(len(r.prompt) for r in reqs)
    ct = sum(len(o.tokens) for o in outs)
    return Usage(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct)
