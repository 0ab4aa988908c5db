"""Token-by-token streaming on the OpenAI routes, with the real `openai` package against a
real server process whose decode slices are 1 ms long (about one token a slice), so a
reply of many tokens goes out in many chunks."""

from __future__ import annotations

import openai
import pytest

from .conftest import keyed_server

pytestmark = pytest.mark.integration

PROMPT = "The cat sat on the"


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_cache):
    proc = keyed_server(tmp_path_factory.mktemp("oai-stream"), "--decode-slice-ms", "1")
    yield openai.OpenAI(base_url=f"http://{proc.http_address}/oai/api/v1",
                        api_key=proc.keys["alice"], max_retries=0)
    proc.stop()


def pieces(stream) -> tuple[dict[int, list[str]], dict[int, str], list]:
    """Each choice's text chunks in order, its finish reason, and every chunk."""
    texts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            text = choice.text if hasattr(choice, "text") else choice.delta.content
            if text:
                texts.setdefault(choice.index, []).append(text)
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def test_a_long_completion_streams_in_many_chunks_that_join_to_the_whole_reply(client):
    asked = dict(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0.0, n=2)
    whole = client.completions.create(**asked)
    texts, finish, chunks = pieces(client.completions.create(
        **asked, stream=True, stream_options={"include_usage": True}))
    assert whole.usage.completion_tokens >= 16   # long enough to span many slices
    for choice in whole.choices:
        assert "".join(texts[choice.index]) == choice.text
        assert finish[choice.index] == choice.finish_reason
        assert len(texts[choice.index]) > 1
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_chat_stream_joins_to_the_whole_reply(client):
    asked = dict(model="tiny", messages=[{"role": "user", "content": "Say hi."}],
                 max_tokens=24, temperature=0.0)
    whole = client.chat.completions.create(**asked)
    texts, finish, _ = pieces(client.chat.completions.create(**asked, stream=True))
    assert "".join(texts.get(0, [])) == whole.choices[0].message.content
    assert finish == {0: whole.choices[0].finish_reason}


def test_a_stop_string_is_held_back_until_it_cannot_match_and_never_streamed(client):
    asked = dict(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0.0)
    free = client.completions.create(**asked).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    whole = client.completions.create(**asked, stop=[stop]).choices[0]
    texts, finish, _ = pieces(client.completions.create(**asked, stop=[stop], stream=True))
    assert whole.finish_reason == "stop" and stop not in whole.text
    assert "".join(texts.get(0, [])) == whole.text and finish == {0: "stop"}
    assert all(stop not in text for text in texts.get(0, []))


def test_a_stream_with_logprobs_carries_each_chunks_tokens_and_their_logprobs(client):
    asked = dict(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0.0, logprobs=2)
    whole = client.completions.create(**asked).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**asked, stream=True)
              if c.choices]
    carried = [c for c in chunks if c.logprobs and c.logprobs.tokens]
    assert len(carried) > 1                  # token by token, not one chunk at the end
    for chunk in chunks:                     # each chunk's text is its tokens' text
        pieces = "".join(chunk.logprobs.tokens if chunk.logprobs else [])
        # (a token holding part of a character's bytes is named by its bytes, as OpenAI
        # names it: "bytes:\\x8f...")
        assert pieces == chunk.text or "bytes:" in pieces
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    values = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    tops = [d for c in chunks if c.logprobs for d in c.logprobs.top_logprobs]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    # The same request alone twice: same shapes, same kernels, the same numbers.
    assert values == whole.logprobs.token_logprobs and tops == whole.logprobs.top_logprobs


def test_a_chat_stream_with_logprobs_joins_to_the_whole_replys_logprobs(client):
    asked = dict(model="tiny", messages=[{"role": "user", "content": "Say hi."}],
                 max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**asked).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(**asked, stream=True)
              if c.choices]
    content = [t for c in chunks if c.logprobs for t in c.logprobs.content or ()]
    assert sum(1 for c in chunks if c.logprobs and c.logprobs.content) > 1
    assert [t.token for t in content] == [t.token for t in whole.logprobs.content]
    assert [t.logprob for t in content] == [t.logprob for t in whole.logprobs.content]
    assert "".join(c.delta.content or "" for c in chunks) == whole.message.content
