"""Token-by-token streams on several ranks: the pool's partial rows reach the HTTP front
from rank 0's pool share and from a sampler rank alike, under the real launcher, with
1 ms decode slices (about a token a slice)."""

from __future__ import annotations

import openai
import pytest

from twinkle_server.process import start_server

pytestmark = pytest.mark.integration

LAYOUTS = {"two ranks": ("--nproc-per-node", "2"),
           "a sampler rank": ("--nproc-per-node", "2", "--sampler-ranks", "1")}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def client(request, tmp_path_factory, tiny_cache):
    server = start_server(tmp_path_factory.mktemp("streams"), *LAYOUTS[request.param],
                          "--decode-slice-ms", "1", http=True)
    yield openai.OpenAI(base_url=f"http://{server.http_address}/oai/api/v1",
                        api_key="keyless", max_retries=0)
    assert server.stop() == 0, server.log()[-3000:]


def test_a_stream_with_logprobs_arrives_in_many_chunks_that_join_to_the_whole(client):
    asked = dict(model="tiny", prompt="The cat sat on the", max_tokens=32, temperature=0.0,
                 logprobs=1, n=2)
    whole = client.completions.create(**asked)
    chunks = [c for c in client.completions.create(**asked, stream=True) if c.choices]
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert sum(1 for c in mine if c.text) > 1
        assert "".join(c.text for c in mine) == choice.text
        assert [t for c in mine if c.logprobs for t in c.logprobs.tokens] == \
            choice.logprobs.tokens
