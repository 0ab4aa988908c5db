"""One keyed server with its HTTP front for the package: tenants alice and bob, each with
a `tml-` key made by the CLI; the stock `tinker` SDK, unpatched, talks to it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from twinkle_server.process import start_server  # noqa: E402

from ..service.harness import create_key  # noqa: E402
from ..tinker_compat.conftest import sft_data  # noqa: E402, F401 - the same data both fronts get


def keyed_server(data_dir, *flags: str):
    """A server process with its HTTP front on `data_dir`, run with `flags`, and a `tml-`
    key each for tenants alice and bob (`proc.keys`), made by the CLI before it starts."""
    keys = {tenant: create_key(data_dir, tenant) for tenant in ("alice", "bob")}
    proc = start_server(data_dir, *flags, http=True)
    proc.keys = keys
    return proc


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_cache):
    # The package's server, kept for the test session (a package scope ends each time a
    # worker turns to another package's file, and the server started again, up to six
    # times a worker). Cases create models it keeps until their session ends: room for
    # all of them, as tests/tinker_compat/conftest.py gives its server.
    proc = keyed_server(tmp_path_factory.mktemp("http-server"),
                        "--max-adapters-per-tenant", "32", "--max-adapters", "64")
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return f"http://{server.http_address}"


@pytest.fixture(scope="session")
def service(server, base_url):
    client = tinker.ServiceClient(base_url=base_url, api_key=server.keys["alice"])
    yield client
    client.close("success").result()


@pytest.fixture(scope="session")
def bob(server, base_url):
    client = tinker.ServiceClient(base_url=base_url, api_key=server.keys["bob"])
    yield client
    client.close("success").result()


def rl_data(n: int = 4, length: int = 16, seed: int = 1) -> list[types.Datum]:
    """Datums for importance_sampling / ppo: sampler logprobs and advantages."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(n):
        ids = rng.integers(3, 200, length + 1)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
            loss_fn_inputs={"target_tokens": ids[1:],
                            "logprobs": rng.normal(-8.3, 0.1, length).astype(np.float32),
                            "advantages": rng.normal(0, 1, length).astype(np.float32)}))
    return data


def download(urls: dict[str, str], dest: Path) -> Path:
    """Fetch every URL with no API key into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    with httpx.Client(timeout=60) as plain:
        for name, url in urls.items():
            r = plain.get(url)
            assert r.status_code == 200, (name, r.status_code, r.text)
            (dest / name).write_bytes(r.content)
    return dest


def peft_logprobs(model_dir: str, adapter: Path, data: list[types.Datum]
                  ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Target logprobs of `data` from `PeftModel.from_pretrained(base, adapter)`, and from
    the base alone (the adapter disabled)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()

    def run() -> list[np.ndarray]:
        out = []
        for datum in data:
            ids = torch.tensor([datum.model_input.to_ints()])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            targets = torch.as_tensor(datum.loss_fn_inputs["target_tokens"].to_numpy())
            out.append(logp.gather(-1, targets[:, None].long())[:, 0].numpy())
        return out

    with torch.no_grad():
        adapted = run()
        with model.disable_adapter():
            plain = run()
    return adapted, plain


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
"""The one tool `tool_caller` learns to call, in OpenAI's shape."""
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris, 21 C."
END = "<|im_end|>"
"""The tiny model's end of turn, its stop token."""
RESULT = "sunny, 21 C"


HARMONY_TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n"
    "{%- for tool in tools %}\n// {{ tool.function.description }}\n"
    "type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;"
    "{%- endfor %}\n} // namespace functions<|end|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined %}"
    "{%- for call in message.tool_calls %}<|start|>assistant<|channel|>commentary "
    "to=functions.{{ call.function.name }} <|constrain|>json<|message|>"
    "{{ call.function.arguments | tojson }}<|call|>{%- endfor %}"
    "{%- elif message.role == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'tool' %}<|start|>functions."
    "{{ messages[loop.index0 - 1].tool_calls[0].function.name }} to=assistant"
    "<|channel|>commentary<|message|>{{ message.content }}<|end|>"
    "{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
"""gpt-oss's Harmony format in a short template of our own: tools as a TypeScript
namespace, a call as a message to `functions.NAME`, the answer on the `final` channel."""
HARMONY_CALL = ('<|channel|>commentary to=functions.get_weather <|constrain|>json'
                '<|message|>{"city": "Paris"}<|call|>')
HARMONY_ANSWER = ("<|channel|>analysis<|message|>The tool says sunny.<|end|><|start|>"
                  f"assistant<|channel|>final<|message|>{ANSWER}<|return|>")


def harmony_model(root: Path, tiny_cache: Path) -> Path:
    """The tiny model under Harmony's chat template (its tokenizer has gpt-oss's special
    tokens), stopping as gpt-oss does on `<|call|>` and `<|return|>` besides its end of
    turn: a directory to serve as a Harmony model."""
    from transformers import AutoTokenizer

    from twinkle_server.engine.tiny_model import build_tiny_model

    out = root / "harmony"
    shutil.copytree(build_tiny_model(tiny_cache), out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = HARMONY_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    stops = AutoTokenizer.from_pretrained(out).convert_tokens_to_ids(
        ["<|im_end|>", "<|return|>", "<|call|>"])
    model = json.loads((out / "config.json").read_text())
    model["eos_token_id"] = stops
    (out / "config.json").write_text(json.dumps(model))
    return out


def tool_caller(proc, tenant: str = "alice", base: str = "tiny",
                tokenizer_dir: Path | None = None,
                replies: tuple[str, str] = (CALL + END, ANSWER + END)) -> str:
    """A sampler checkpoint of `tenant`'s on `proc`, trained on `base` by the stock SDK
    until it answers `ASK` (with `WEATHER` offered) with `replies[0]` (a call), and the
    call's `RESULT` with `replies[1]` (each reply ends with a stop token of the base): a
    model as an agent. The conversation is rendered by the base's own chat template
    (`tokenizer_dir`'s; the tiny model's by default), as the routes render it, and trained
    as one datum: the template renders the call in the history as the model says it. About
    120 steps at lr 2e-3 take the loss from ~440 to below 1 nat (measured on tiny)."""
    from transformers import AutoTokenizer

    from twinkle_server.engine.tiny_model import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or build_tiny_model())
    called = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    answered = {"role": "tool", "tool_call_id": "call_1", "content": RESULT}
    asked, after = (tokenizer.apply_chat_template(
        messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
        for messages in (ASK, [*ASK, called, answered]))
    assert after.startswith(asked + replies[0]), (asked, after)
    ids, weights = [], []
    for text, weight in ((asked, 0.0), (replies[0], 1.0),
                         (after[len(asked) + len(replies[0]):], 0.0), (replies[1], 1.0)):
        tokens = tokenizer.encode(text, add_special_tokens=False)
        ids += tokens
        weights += [weight] * len(tokens)
    data = [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(ids[1:], np.int64),
                                        "weights": np.array(weights[1:], np.float32)})]
    service = tinker.ServiceClient(base_url=f"http://{proc.http_address}",
                                   api_key=proc.keys[tenant])
    training = service.create_lora_training_client(base_model=base, rank=32,
                                                   seed=1).result()
    # Pipelined: the server runs a model's ops in submission order, and no round trip
    # waits between them.
    steps = [(training.forward_backward(data, "cross_entropy"),
              training.optim_step(types.AdamParams(learning_rate=2e-3)))
             for _ in range(120)]
    for step in steps:
        for future in step:
            future.result()
    return training.save_weights_for_sampler("agent").result().path
