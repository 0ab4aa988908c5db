"""A chat or completion request's sampled rows as the text its client is shown, for the
OpenAI and Anthropic routes alike: what a stream may carry of each choice while it
decodes, and each finished choice's text, tool calls and reason.

A stream holds back what could still change: the last characters a stop string could
begin in, a character whose bytes are not all drawn, and, where the reply may hold tool
calls, everything from where a call may begin (and the whitespace around the text, which
a reply with tools is shown without) until the reply is whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import numpy as np

from twinkle_server.engine.types import Progress, SampledSequence
from twinkle_server.http.tool_calls import ToolCall, ToolFormat, ToolUse
from twinkle_server.runtime.bases import Served


@dataclass(frozen=True)
class Delta:
    """New text of choice `index` that may go out now, and (where the stream is token
    aligned) the tokens it is the text of: `row.tokens[first:last]`."""

    index: int
    text: str
    row: SampledSequence
    first: int
    last: int


@dataclass(frozen=True)
class Finished:
    """A finished choice: its text (None: a reply of calls only), its calls, why it ended
    ("stop", "length" or "tool_calls") and the stop string that ended it, if one did."""

    text: str | None
    calls: tuple[ToolCall, ...]
    reason: str
    stop_sequence: str | None


class Decoded:
    """The text of one request's choices (`n` a prompt), as they decode and once done.
    `tools` and `tool_format` read calls back from the replies; `forced` is the start of
    each reply the prompt already holds (a call `tool_choice` requires). A
    `token_aligned` stream cuts its text only between tokens, so each piece goes out with
    the tokens it is made of (and their logprobs)."""

    def __init__(self, served: Served, stops: tuple[str, ...], n: int,
                 streamed: bool, tools: ToolUse | None = None,
                 tool_format: ToolFormat | None = None, forced: str = "",
                 token_aligned: bool = False) -> None:
        self.base = served.engine.base
        self.stops, self.n, self.streamed = stops, n, streamed
        self.tools, self.tool_format, self.forced = tools, tool_format, forced
        self.token_aligned = token_aligned
        self._progress: asyncio.Queue[tuple[int, Progress]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        # What each choice's stream has carried so far, and of how many tokens.
        self._sent: dict[int, str] = {}
        self._sent_tokens: dict[int, int] = {}

    def hear(self, prompt: int) -> Callable[[Progress], None] | None:
        """The listener for prompt `prompt`'s progress (from the scheduler's thread onto
        this loop), or None where the reply is not streamed as it decodes."""
        if not self.streamed:
            return None
        loop, queue = self._loop, self._progress
        return lambda progress: loop.call_soon_threadsafe(queue.put_nowait,
                                                          (prompt, progress))

    async def deltas(self, work: asyncio.Future) -> AsyncIterator[Delta]:
        """The choices' new text as they decode, until `work` is done."""
        heard: asyncio.Future | None = None
        try:
            while not work.done():
                heard = asyncio.ensure_future(self._progress.get())
                await asyncio.wait({work, heard}, return_when=asyncio.FIRST_COMPLETED)
                if not heard.done():
                    return
                for delta in self._partial_texts(*heard.result()):
                    yield delta
        finally:
            if heard is not None:
                heard.cancel()

    def _partial_texts(self, prompt: int, progress: Progress) -> Iterator[Delta]:
        if self.tool_format is not None and self.tool_format.special_tokens:
            return                  # what a reply shows is known once it is whole
        hold = max((len(s) for s in self.stops), default=1) - 1
        for r, row in enumerate(progress.rows):
            index = prompt * self.n + r
            drawn = self.base.decode(row.tokens.tolist())
            # A row stopped on a stop string ends where the engine says it begins.
            safe = len(drawn) - hold if row.stop_text_at is None else row.stop_text_at
            while safe > 0 and drawn[safe - 1] == "\ufffd":
                safe -= 1
            first = last = self._sent_tokens.get(index, 0)
            if self.token_aligned:
                last, safe = self._boundary(row.tokens, drawn, first, safe)
            text, safe, lead = self.forced + drawn, safe + len(self.forced), 0
            if self.tools is not None and self.tool_format is not None:
                lead = len(text) - len(text.lstrip())
                start = self.tool_format.call_start(text)
                safe = min(safe, len(text.rstrip()), len(text) if start is None else start)
            sent = self._sent.get(index, "")
            if safe - lead > len(sent) and text[lead:].startswith(sent):
                self._sent[index] = text[lead:safe]
                self._sent_tokens[index] = last
                yield Delta(index, text[lead + len(sent):safe], row, first, last)

    def _boundary(self, tokens: np.ndarray, drawn: str, sent: int, safe: int
                  ) -> tuple[int, int]:
        """The most tokens (from `sent` on) whose text is whole and within `drawn[:safe]`,
        and that text's length."""
        best = (sent, len(self.base.decode(tokens[:sent].tolist())))
        for k in range(sent + 1, tokens.size + 1):
            text = self.base.decode(tokens[:k].tolist())
            if len(text) > safe:
                break
            if drawn.startswith(text) and not text.endswith("\ufffd"):
                best = (k, len(text))
        return best

    def finished(self, seq: SampledSequence) -> Finished:
        """A finished row as its client is shown it. The engine searched for the stop
        strings in this same text and says where the one it stopped on begins: the text
        leaves it out."""
        drawn = self.base.decode(seq.tokens.tolist())
        stop = None if seq.stop_text_at is None else next(
            (s for s in self.stops if drawn.startswith(s, seq.stop_text_at)), None)
        reason = "stop" if seq.stop_reason == "stop" else "length"
        plain = self.forced + drawn[:seq.stop_text_at]
        writes = self.tool_format
        if writes is None:
            return Finished(plain, (), reason, stop)
        read = shown = plain      # what calls are read from, and what the reply shows
        if writes.special_tokens:
            read = self.forced + self.base.tokenizer.decode(seq.tokens.tolist(),
                                                            skip_special_tokens=False)
            channels = writes.text(read)
            if channels is not None:
                shown = channels[:channels.rfind(stop)] if stop and stop in channels \
                    else channels
        if self.tools is None:             # a Harmony reply without tools
            return Finished(shown, (), reason, stop)
        parsed = writes.parse(read, self.tools.tools)
        if parsed is None:
            return Finished(shown.strip(), (), reason, stop)
        return Finished(parsed.content, parsed.calls, "tool_calls", stop)

    def rest(self, index: int, text: str | None) -> str:
        """What choice `index`'s stream has not carried yet of its whole `text`."""
        return (text or "")[len(self._sent.get(index, "")):]

    def sent_tokens(self, index: int) -> int:
        """How many of choice `index`'s tokens a token-aligned stream has carried."""
        return self._sent_tokens.get(index, 0)
