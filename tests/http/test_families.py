"""The families Tinker users train, through the stock `tinker` SDK, unchanged (issue 44).

One server with default flags serves a tiny random model of each family
(`tests/engine/families.py`) under the family's name (`--models`), sampling in its decode
pool (a hybrid's recurrent states, a sliding window and gpt-oss's sinks too).

Per family, Tinker's default `LoraConfig` (attention, MLP, unembed; experts per expert)
trains 4 steps and the loss falls; the trained weights sample, and the sampler's logprobs
of its own tokens, and its `compute_logprobs` of the whole sequence, are the trainer's;
the next turn, which extends the sample, reuses the cached prefix (with a hybrid's
recurrent states, a window's last positions) and samples what the trainer scores;
`save_weights_external` downloads through its signed URLs and loads in `peft` with the
server's logprobs. The engine and peft, and the sampler's and the trainer's passes, add
in different orders: they agree within the isolation contract's bounds
(`tests/numerics.py`; recurrent mixers carry a state whose rounding grows along the
sequence: STATE_LOGPROB_ATOL).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tinker
import transformers
from packaging.version import Version
from tinker import types

from twinkle_server.engine import recurrent

from ..engine.families import MIXER_FAMILIES, write_family
from ..numerics import LOGPROB_ATOL, STATE_LOGPROB_ATOL
from .conftest import download, keyed_server, peft_logprobs

pytestmark = pytest.mark.integration

FAMILIES = ["phi3", "qwen3_moe", "glm4_moe", "gpt_oss", "gemma3_text", "qwen3_next",
            "qwen3_5_text", "qwen3_5_moe_text", "nemotron_h"]
"""The families whose layers differ from Llama's (fused projections, experts, sliding
windows and sinks, Gated DeltaNet and Mamba2 mixers); Llama-shaped ones: tests/engine."""
STEPS = 4
UNSERVED_EXPERTS = "are not computed by this engine's expert LoRA"
"""The refusal an older transformers' experts get (`engine.experts.targets`)."""


def _served() -> list[str]:
    """The families the installed transformers has and the engine serves: under one older
    than `recurrent.VERIFIED_TRANSFORMERS` the engine refuses mixers at load."""
    old = Version(transformers.__version__) < Version(recurrent.VERIFIED_TRANSFORMERS)
    from ..engine.families import FAMILIES as CONFIGS
    return [f for f in FAMILIES if hasattr(transformers, CONFIGS[f][0])
            and not (old and f in MIXER_FAMILIES)]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_cache):
    """Each family served: the server, an SDK client of it and the family's directory."""
    root = tmp_path_factory.mktemp("models")
    dirs = {family: write_family(root, family, tiny_cache) for family in _served()}
    models = root / "models.toml"
    models.write_text("".join(f'[[models]]\nname = "{f}"\npath = "{d}"\n\n'
                              for f, d in dirs.items()))
    proc = keyed_server(tmp_path_factory.mktemp("families-server"), "--models", str(models),
                        "--max-adapters-per-tenant", "16")
    client = tinker.ServiceClient(base_url=f"http://{proc.http_address}",
                                  api_key=proc.keys["alice"])
    yield {family: (proc, client, path) for family, path in dirs.items()}
    client.close("success").result()
    proc.stop()


def _data(length: int = 12) -> list[types.Datum]:
    ids = np.arange(3, 3 + length + 1) * 37 % 400 + 3
    return [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": ids[1:],
                                        "weights": np.ones(length, np.float32)})]


def _training_client(client: tinker.ServiceClient, family: str, **switches: bool):
    try:
        return client.create_lora_training_client(base_model=family, rank=8, seed=1,
                                                  **switches).result()
    except tinker.RequestFailedError as exc:
        if UNSERVED_EXPERTS in str(exc):
            pytest.skip(f"transformers {transformers.__version__}: {exc}")
        raise


def _scored(training: tinker.TrainingClient, tokens: list[int]) -> np.ndarray:
    """The trainer's logprob of each of `tokens` but the first."""
    return training.forward(
        [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                     loss_fn_inputs={"target_tokens": np.asarray(tokens[1:]),
                                     "weights": np.ones(len(tokens) - 1, np.float32)})],
        "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_sdks_default_lora_trains_samples_and_exports_to_peft(served, family, tmp_path):
    if family not in served:
        pytest.skip(f"transformers {transformers.__version__} cannot serve {family} "
                    "(no config class, or mixers the engine refuses there)")
    proc, client, model_dir = served[family]
    atol = STATE_LOGPROB_ATOL if family in MIXER_FAMILIES else LOGPROB_ATOL
    training = _training_client(client, family)
    losses = []
    for _ in range(STEPS):
        losses.append(training.forward_backward(_data(), "cross_entropy").result()
                      .metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[-1] < 0.95 * losses[0], losses

    # The trained weights sample; the trainer scores the sampled tokens alike.
    prompt = _data()[0].model_input.to_ints()
    sampler = training.save_weights_and_get_sampling_client()
    sample = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                            sampling_params=types.SamplingParams(max_tokens=6, seed=5)
                            ).result().sequences[0]
    assert len(sample.tokens) == 6
    full = prompt + sample.tokens
    scored = _scored(training, full)
    np.testing.assert_allclose(sample.logprobs, scored[-len(sample.tokens):], atol=atol,
                               rtol=0)
    # The sampler scores the whole sequence as the trainer does (its first token: None).
    computed = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    np.testing.assert_allclose(np.asarray(computed[1:], np.float32), scored, atol=atol,
                               rtol=0)
    # The next turn extends the sample: it goes on from what the pool kept at the end
    # of the sampled sequence but its last token (or of `full`, where the SDK's
    # `compute_logprobs` sampled it in this session): keys and values, a window's last
    # ones, a hybrid's states; and samples what the trainer scores.
    turn = full + [prompt[0]]
    reply = sampler.sample(types.ModelInput.from_ints(turn), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=4, seed=6)
                           ).result()
    assert reply.prompt_cache_hit_tokens in (len(full) - 1, len(full))
    tokens = reply.sequences[0].tokens
    np.testing.assert_allclose(reply.sequences[0].logprobs,
                               _scored(training, turn + tokens)[-len(tokens):],
                               atol=atol, rtol=0)

    # The export loads in peft with the server's logprobs, and the adapter matters.
    path = training.save_weights_external("final").result().path
    rest = tinker.RestClient(base_url=f"http://{proc.http_address}",
                             api_key=proc.keys["alice"])
    adapter = download(rest.get_external_weights_urls(path).result().urls, tmp_path / "out")
    ours = training.forward(_data(), "cross_entropy").result().loss_fn_outputs[0][
        "logprobs"].to_numpy()
    theirs, plain = peft_logprobs(str(model_dir), adapter, _data())
    np.testing.assert_allclose(ours, theirs[0], atol=atol, rtol=0)
    assert np.abs(ours - plain[0]).max() > 10 * atol


def test_the_sdks_switches_select_by_role_on_fused_layers(served, tmp_path):
    proc, client, _ = served["phi3"]
    attention_only = _training_client(client, "phi3", train_mlp=False, train_unembed=False)
    # Served as "phi3" from a local directory: the SDK is told the directory, which it
    # loads (a name that is no hub id once sent it to the hub).
    assert attention_only.get_tokenizer().encode("hello")
    assert np.isfinite(attention_only.forward_backward(_data(), "cross_entropy").result()
                       .metrics["loss:sum"])
    path = attention_only.save_weights_external("attention").result().path
    rest = tinker.RestClient(base_url=f"http://{proc.http_address}",
                             api_key=proc.keys["alice"])
    adapter = download(rest.get_external_weights_urls(path).result().urls, tmp_path / "out")
    config = json.loads((adapter / "adapter_config.json").read_text())
    # phi3's attention is its fused qkv_proj and o_proj; its MLP (gate_up_proj, down_proj)
    # and the unembedding are left alone.
    assert {m.rsplit(".", 1)[-1] for m in config["target_modules"]} == {"o_proj", "qkv_proj"}
