"""The OpenAI routes' answers: a request's choices whole or streamed token by token in
OpenAI's shapes (`Reply`), and OpenAI's error body for any error (`error_response`)."""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
from starlette.responses import JSONResponse

from twinkle_server.engine.types import SampledSequence
from twinkle_server.http.decoded import Decoded
from twinkle_server.http.errors import category_of, message_of
from twinkle_server.http.oai_request import OaiRequest
from twinkle_server.http.tool_calls import ToolFormat
from twinkle_server.runtime.bases import Served
from twinkle_server.runtime.sampling import SampleResult

ERRORS = {
    "invalid_argument": (400, "invalid_request_error"),
    "failed_precondition": (400, "invalid_request_error"),
    "unauthenticated": (401, "authentication_error"),
    "permission_denied": (403, "permission_error"),
    "not_found": (404, "invalid_request_error"),
    "resource_exhausted": (429, "rate_limit_error"),
    "cancelled": (499, "invalid_request_error"),
    "unavailable": (503, "server_error"),
}


def error_response(exc: BaseException) -> JSONResponse:
    """OpenAI's error body and the status for `exc`."""
    category = category_of(exc)
    status, kind = ERRORS.get(category, (500, "server_error"))
    param = getattr(exc, "param", None)
    code = {"unauthenticated": "invalid_api_key",
            "not_found": "model_not_found" if param == "model" else None}.get(category)
    return JSONResponse({"error": {"message": message_of(exc), "type": kind,
                                   "param": param, "code": code}}, status)


class Reply:
    """One request's answer, whole or streamed, in OpenAI's shapes."""

    def __init__(self, route: str, asked: OaiRequest, served: Served,
                 prompts: Sequence[np.ndarray], tool_format: ToolFormat | None = None,
                 forced: str = "") -> None:
        self.route, self.asked, self.prompts = route, asked, prompts
        # Token by token, each chunk with its tokens' logprobs when asked; an echo, and
        # logprobs beside tools, come whole (one chunk a choice, once it is decoded).
        incremental = asked.stream and not asked.echo and not (
            asked.tools and asked.top_logprobs is not None)
        self.decoded = Decoded(served, asked.stop, asked.n, incremental, asked.tools,
                               tool_format, forced,
                               token_aligned=incremental and asked.top_logprobs is not None)
        self.base = served.engine.base
        self.tokenizer = served.engine.base.tokenizer
        self.id = ("chatcmpl-" if route == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if route == "chat" else "text_completion"

    def _choices(self, results: Sequence[SampleResult]) -> list[dict[str, Any]]:
        choices = []
        for p, result in enumerate(results):
            for s, seq in enumerate(result.sequences):
                choices.append(self._choice(p * self.asked.n + s, p, seq, result))
        return choices

    def _choice(self, index: int, prompt: int, seq: SampledSequence,
                result: SampleResult) -> dict[str, Any]:
        done = self.decoded.finished(seq)
        if self.route == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": done.text}
            if done.calls:
                message["tool_calls"] = [
                    {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                     "function": {"name": call.name,
                                  "arguments": json.dumps(call.arguments)}}
                    for call in done.calls]
            return {"index": index, "message": message,
                    "logprobs": self._chat_logprobs(seq), "finish_reason": done.reason}
        logprobs = self._completion_logprobs(seq, prompt, result)
        text = done.text or ""
        if self.asked.echo:
            text = self._prompt_text(prompt) + text
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": done.reason}

    def _prompt_text(self, prompt: int) -> str:
        return self.base.decode(self.prompts[prompt].tolist())

    def _piece(self, token: int) -> str:
        return token_text(self.tokenizer, int(token))

    def _chat_logprobs(self, seq: SampledSequence) -> dict[str, Any] | None:
        if self.asked.top_logprobs is None:
            return None
        content = []
        for i, (token, logprob) in enumerate(zip(seq.tokens, seq.logprobs, strict=True)):
            piece = self._piece(token)
            top = []
            if seq.topk_token_ids is not None and seq.topk_logprobs is not None:
                top = [{"token": self._piece(t), "logprob": float(lp),
                        "bytes": list(token_bytes(self.tokenizer, int(t)))}
                       for t, lp in zip(seq.topk_token_ids[i], seq.topk_logprobs[i],
                                        strict=True)][:self.asked.top_logprobs]
            content.append({"token": piece, "logprob": float(logprob),
                            "bytes": list(token_bytes(self.tokenizer, int(token))),
                            "top_logprobs": top})
        return {"content": content}

    def _completion_logprobs(self, seq: SampledSequence, prompt: int,
                             result: SampleResult | None) -> dict[str, Any] | None:
        """Completions' logprobs of `seq` (after `result`'s prompt's, with echo)."""
        if self.asked.top_logprobs is None:
            return None
        tokens: list[int] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if self.asked.echo and result is not None \
                and (scored := result.prompt_logprobs) is not None:
            ids = self.prompts[prompt].tolist()
            tokens += ids
            values += [None] + [float(v) for v in scored.logprobs[1:]]
            tops += [None] + [self._top(ids[i], float(scored.logprobs[i]),
                                        scored.topk_token_ids, scored.topk_logprobs, i)
                              for i in range(1, len(ids))]
        tokens += seq.tokens.tolist()
        values += [float(v) for v in seq.logprobs]
        tops += [self._top(int(t), float(lp), seq.topk_token_ids, seq.topk_logprobs, i)
                 for i, (t, lp) in enumerate(zip(seq.tokens, seq.logprobs, strict=True))]
        # The text is the prompt's and the completion's, each decoded alone.
        echoed = len(tokens) - seq.tokens.size
        offsets = text_offsets(self.tokenizer, tokens[:echoed])
        offsets += text_offsets(self.tokenizer, tokens[echoed:],
                                len(self._prompt_text(prompt)) if echoed else 0)
        return {"tokens": [self._piece(t) for t in tokens], "token_logprobs": values,
                "top_logprobs": tops, "text_offset": offsets}

    def _top(self, chosen: int, logprob: float, ids: np.ndarray | None,
             logprobs: np.ndarray | None, position: int) -> dict[str, float]:
        """One position's `top_logprobs` dict: its k likeliest tokens and, as OpenAI
        gives it, the chosen one too (so k or k + 1 entries)."""
        top: dict[str, float] = {}
        if ids is not None and logprobs is not None:
            for t, lp in list(zip(ids[position], logprobs[position],
                                  strict=True))[:self.asked.top_logprobs]:
                top.setdefault(self._piece(t), float(lp))
        top.setdefault(self._piece(chosen), logprob)
        return top

    def _usage(self, results: Sequence[SampleResult]) -> dict[str, int]:
        prompt = sum(int(p.size) for p in self.prompts)
        completion = sum(int(s.tokens.size) for r in results for s in r.sequences)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def whole(self, results: Sequence[SampleResult]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.asked.model, "choices": self._choices(results),
                "usage": self._usage(results)}

    async def stream(self, work: asyncio.Future) -> AsyncIterator[str]:
        """Server-sent events: for chat, each choice's role first; each choice's text as
        it is decoded (a chunk a decode slice, with its tokens' logprobs when asked; whole,
        once decoded, with echo or with logprobs beside tools), then its tool calls and
        finish reason; the usage when asked;
        `[DONE]`. A client gone away cancels this, and with it the request's samples."""
        chunk = {"id": self.id, "object": f"{self.object}.chunk" if self.route == "chat"
                 else self.object, "created": self.created, "model": self.asked.model}
        count = len(self.prompts) * self.asked.n
        try:
            if self.route == "chat":
                for index in range(count):
                    yield _event({**chunk, "choices": [{
                        "index": index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]})
            async for delta in self.decoded.deltas(work):
                event = self._text_delta(delta.index, delta.text)
                if self.asked.top_logprobs is not None:
                    event["logprobs"] = self._logprobs_of(delta.row, delta.first,
                                                          delta.last)
                yield _event({**chunk, "choices": [event]})
            try:
                results = work.result()
            except Exception as exc:
                yield _event(json.loads(error_response(exc).body))
                yield "data: [DONE]\n\n"
                return
            seqs = [seq for result in results for seq in result.sequences]
            for choice, seq in zip(self._choices(results), seqs, strict=True):
                for event in self._last_of(choice, seq):
                    yield _event({**chunk, "choices": [event]})
            if self.asked.include_usage:
                yield _event({**chunk, "choices": [], "usage": self._usage(results)})
            yield "data: [DONE]\n\n"
        finally:
            work.cancel()

    def _text_delta(self, index: int, text: str, finish: str | None = None
                    ) -> dict[str, Any]:
        if self.route == "chat":
            return {"index": index, "delta": {"content": text} if text else {},
                    "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    def _logprobs_of(self, seq: SampledSequence, first: int, last: int
                     ) -> dict[str, Any] | None:
        """The logprobs of `seq.tokens[first:last]` as a chunk carries them (completions'
        offsets counted from the choice's start)."""
        if self.route == "chat":
            whole = self._chat_logprobs(seq)
            return whole and {"content": whole["content"][first:last]}
        whole = self._completion_logprobs(seq, 0, None)
        return whole and {key: values[first:last] for key, values in whole.items()}

    def _last_of(self, choice: dict[str, Any], seq: SampledSequence
                 ) -> list[dict[str, Any]]:
        """A finished choice's last events: what its stream has not carried yet, with its
        logprobs, then its tool calls, then its finish reason."""
        index, finish = choice["index"], choice.pop("finish_reason")
        logprobs = choice["logprobs"]
        if self.decoded.token_aligned:
            logprobs = self._logprobs_of(seq, self.decoded.sent_tokens(index),
                                         seq.tokens.size)
        if self.route != "chat":
            return [{**choice, "text": self.decoded.rest(index, choice["text"]),
                     "logprobs": logprobs, "finish_reason": finish}]
        message = choice["message"]
        events = [{"index": index,
                   "delta": {"content": self.decoded.rest(index, message["content"])},
                   "logprobs": logprobs, "finish_reason": None}]
        if calls := message.get("tool_calls"):
            events.append({"index": index, "delta": {"tool_calls": [
                {"index": j, **call} for j, call in enumerate(calls)]},
                "logprobs": None, "finish_reason": None})
        return [*events, self._text_delta(index, "", finish)]


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes token `token` stands for. Decoded alone, a token that holds part of a
    character decodes to U+FFFD, as does every other such token; its bytes are then read
    from its vocabulary entry: a byte-fallback `<0xNN>` piece (SentencePiece), or
    byte-level BPE's alphabet (GPT-2, Qwen, Llama 3)."""
    text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    if all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return text.encode()


def text_offsets(tokenizer: Any, tokens: Sequence[int], start: int = 0) -> list[int]:
    """Where each of `tokens` begins in their text as a client is shown it (special
    tokens left out), counted from `start`: the index of the character its first byte is
    part of, so a token that holds the end of a character begins where that character
    does. Counted from the tokens' bytes (`token_bytes`), as UTF-8 decodes them, never
    from their names (a part of a character is named `bytes:\\xNN`)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    special = set(tokenizer.all_special_ids)
    offsets, at = [], start
    for token in tokens:
        raw = b"" if int(token) in special else token_bytes(tokenizer, int(token))
        # Bytes held for an unfinished character that this token does not go on with
        # become a U+FFFD of their own, before this token's text.
        held = decoder.getstate()[0]
        offsets.append(at + (1 if held and raw and not 0x80 <= raw[0] <= 0xBF else 0))
        at += len(decoder.decode(raw))
    return offsets


def token_text(tokenizer: Any, token: int) -> str:
    """The token as OpenAI names it in `logprobs`: its text, or where its bytes are not
    whole UTF-8 characters, `bytes:` and the bytes escaped (`bytes:\\xe4\\xb8`), so no
    two such tokens share a name."""
    raw = token_bytes(tokenizer, token)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet, character -> byte: a printable Latin-1 byte stands for
    itself; every other byte, in order, for the characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    for rank, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(0x100 + rank)
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()

