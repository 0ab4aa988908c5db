"""How the OpenAI routes name a token in `logprobs` (twinkle_server/http/oai_reply.py):
by its own bytes, as OpenAI does, also where a token holds only part of a character."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from twinkle_server.engine.tiny_model import build_tiny_model
from twinkle_server.http.oai_reply import text_offsets, token_bytes, token_text

TEXT = "héllo 世界 🌍 naïve"


@pytest.fixture(scope="module")
def tokenizer(tiny_cache):
    return AutoTokenizer.from_pretrained(build_tiny_model(tiny_cache))


def test_each_tokens_bytes_join_to_the_texts_bytes(tokenizer):
    """A character split over several tokens: each token's `bytes` is its own part, so a
    client rebuilds the text from them (not three replacement characters)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "no split character"
    assert b"".join(token_bytes(tokenizer, t) for t in ids) == TEXT.encode()


def test_a_token_that_is_part_of_a_character_is_named_by_its_bytes(tokenizer):
    """As OpenAI names such tokens: `bytes:` and their bytes escaped, so two of them never
    share a name (the legacy completions' `top_logprobs` is a dict keyed by it)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    partial = [t for t in ids if "\ufffd" in tokenizer.decode([t])]
    names = {token_text(tokenizer, t) for t in partial}
    assert len(names) == len({token_bytes(tokenizer, t) for t in partial}) > 1
    for t in partial:
        expected = "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes(tokenizer, t))
        assert token_text(tokenizer, t) == expected
    whole = tokenizer.encode(" hello", add_special_tokens=False)
    assert [token_text(tokenizer, t) for t in whole] == [tokenizer.decode([t]) for t in whole]


def test_text_offsets_count_the_characters_of_the_tokens_bytes_not_their_names(tokenizer):
    """A token begins at the character its first byte is part of (the end of a split
    character at that character's start); a special token, left out of the text, takes
    no room; bytes a character never finishes are one U+FFFD before the next token."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    raw = TEXT.encode()
    starts, at = [], 0
    for t in ids:
        starts.append(len(raw[:at].decode("utf-8", "ignore")))
        at += len(token_bytes(tokenizer, t))
    assert text_offsets(tokenizer, ids) == starts
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    after = tokenizer.encode(" ok", add_special_tokens=False)
    tail = 3 + len(TEXT)
    assert text_offsets(tokenizer, [*ids, end, *after], 3)[len(ids):] == \
        [tail] + text_offsets(tokenizer, after, tail)
    cut = next(t for t in ids if "\ufffd" in tokenizer.decode([t])
               and token_bytes(tokenizer, t)[0] >= 0xC0)          # a character's start
    text = tokenizer.decode([cut, *after])
    assert text_offsets(tokenizer, [cut, *after]) == \
        [0, *text_offsets(tokenizer, after, text.index(" ok"))]
