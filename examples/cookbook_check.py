"""Check that loops written the tinker-cookbook way run against Twinkle's Tinker HTTP front.

Run: `make cookbook-check` (it builds `.venv-cookbook` with tinker-cookbook and the stock
`tinker` SDK, then runs this file with that venv's python). By hand, after `make setup`:

    .venv-cookbook/bin/python examples/cookbook_check.py

It starts `.venv/bin/twinkle-server serve --model tiny --http-port 0` (the project's venv;
nothing of twinkle is imported here) and, with `tinker.ServiceClient(base_url=...)`:

* supervised: conversations -> `tinker.Datum` with the cookbook's tokenizer, `qwen3_instruct`
  renderer and `conversation_to_datum`; `forward_backward(cross_entropy)` + `optim_step`
  per step, NLL by `compute_mean_nll`; asserts the NLL goes down.
* RL: a `ProblemEnv` / `ProblemGroupBuilder` toy task sampled with `TinkerTokenCompleter`
  via `do_group_rollout`, advantages by `compute_advantages`, datums by
  `assemble_training_data`, trained with `rl.train.train_step(loss_fn="importance_sampling")`;
  asserts rewards, loss and `compute_kl_sample_train` are finite and that the sampler's and
  trainer's logprobs of the sampled tokens agree.

Exits non-zero on any failure; the server is stopped with SIGTERM either way.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tinker
import torch
from tinker_cookbook import renderers
from tinker_cookbook.completers import TinkerTokenCompleter
from tinker_cookbook.rl.data_processing import assemble_training_data, compute_advantages
from tinker_cookbook.rl.metrics import compute_kl_sample_train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.rollouts import do_group_rollout
from tinker_cookbook.rl.train import train_step
from tinker_cookbook.supervised.common import compute_mean_nll
from tinker_cookbook.supervised.data import conversation_to_datum
from tinker_cookbook.tokenizer_utils import Tokenizer, get_tokenizer

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / ".venv" / "bin" / "twinkle-server"
RENDERER = "qwen3_instruct"  # ChatML without <think>: the tiny model's own chat template
API_KEY = "tml-local"        # the server is open; the SDK only wants the `tml-` prefix

CONVERSATIONS: list[list[renderers.Message]] = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [{"role": "user", "content": "Name a primary colour."},
     {"role": "assistant", "content": "Red."}],
    [{"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Say hello."},
     {"role": "assistant", "content": "Hello."}],
]


def start_server(data_dir: Path, timeout_s: float = 180) -> tuple[subprocess.Popen, str]:
    """Start the server; return it and the `HOST:PORT` of its HTTP front."""
    log_path = data_dir / "server.log"
    proc = subprocess.Popen(
        [str(SERVER), "serve", "--model", "tiny", "--port", "0", "--http-port", "0",
         "--data-dir", str(data_dir)],
        stdout=log_path.open("w"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log_path.read_text()
        # Both lines: `listening on` comes once the gRPC side serves too.
        http = re.search(r"^http listening on (\S+)$", text, re.M)
        if http and re.search(r"^listening on ", text, re.M):
            return proc, http.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{text}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start in {timeout_s}s:\n{log_path.read_text()}")


async def supervised(tc: tinker.TrainingClient, renderer: renderers.Renderer,
                     steps: int = 8) -> list[float]:
    """The cookbook's SFT step: a batch of rendered datums, fwd/bwd + optim, mean NLL."""
    data = [conversation_to_datum(c, renderer, max_length=256) for c in CONVERSATIONS]
    adam = tinker.AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8)
    nlls: list[float] = []
    for step in range(steps):
        fwd_bwd_future = tc.forward_backward(data, loss_fn="cross_entropy")
        optim_future = tc.optim_step(adam)
        fwd_bwd, _ = await fwd_bwd_future, await optim_future
        nll = compute_mean_nll([o["logprobs"] for o in fwd_bwd.loss_fn_outputs],
                               [d.loss_fn_inputs["weights"] for d in data])
        print(f"sft step {step}: nll {nll:.4f}", flush=True)
        nlls.append(nll)
    assert all(math.isfinite(x) for x in nlls), nlls
    assert nlls[-1] < nlls[0], f"SFT loss did not go down: {nlls}"
    return nlls


class LetterEnv(ProblemEnv):
    """Toy single-turn task: correct when the reply contains the letter 'e'."""

    def __init__(self, renderer: renderers.Renderer, question: str):
        super().__init__(renderer, format_coef=0.1)
        self.question = question

    def get_question(self) -> str:
        return self.question

    def check_answer(self, sample_str: str) -> bool:
        return "e" in sample_str

    def check_format(self, sample_str: str) -> bool:
        return sample_str.strip() != ""

    def get_reference_answer(self) -> str:
        return "any reply with an 'e'"


async def rl(tc: tinker.TrainingClient, renderer: renderers.Renderer, iterations: int = 3,
             group_size: int = 4) -> None:
    """The cookbook's RL step: group rollouts, centred advantages, importance sampling."""
    questions = ["Say something.", "Name a fruit."]
    for it in range(iterations):
        sampling_client = await tc.save_weights_and_get_sampling_client()
        policy = TinkerTokenCompleter(sampling_client, max_tokens=16, temperature=1.0)
        builders = [ProblemGroupBuilder(lambda q=q: LetterEnv(renderer, q), group_size)
                    for q in questions]
        groups = await asyncio.gather(*(do_group_rollout(b, policy) for b in builders))
        advantages = compute_advantages(groups)
        data, _ = assemble_training_data(groups, advantages)
        logprobs = await train_step(data, tc, learning_rate=1e-3, num_substeps=1,
                                    loss_fn="importance_sampling")
        kl = compute_kl_sample_train(data, logprobs)  # sampler vs trainer, action tokens
        # The importance-sampling loss the server just took the gradient of (pre-step weights).
        loss = -sum(float((torch.exp(lp - d.loss_fn_inputs["logprobs"].to_torch())
                           * d.loss_fn_inputs["advantages"].to_torch()).sum())
                    for d, lp in zip(data, logprobs, strict=True))
        rewards = [r for g in groups for r in g.get_total_rewards()]
        print(f"rl iter {it}: mean reward {sum(rewards) / len(rewards):.3f}, "
              f"IS loss {loss:.4f}, kl(sample||train) v1 {kl['optim/kl_sample_train_v1']:.2e} "
              f"v2 {kl['optim/kl_sample_train_v2']:.2e}, entropy {kl['optim/entropy']:.3f}, "
              f"datums {len(data)}", flush=True)
        assert len(logprobs) == len(data) == len(questions) * group_size
        assert all(math.isfinite(x) for x in [*rewards, loss, *kl.values()]), (rewards, loss, kl)
        # The sampler and the trainer score the sampled tokens alike.
        assert kl["optim/kl_sample_train_v2"] < 1e-3, kl


async def run(base_url: str) -> None:
    caps = await tinker.RestClient(base_url=base_url, api_key=API_KEY).get_server_capabilities()
    base_model = caps.supported_models[0].model_name
    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    tc = await service.create_lora_training_client(base_model, rank=8, seed=0)
    tokenizer_id = tc.get_info().model_data.tokenizer_id
    assert tokenizer_id, "get_info returned no tokenizer_id"
    tokenizer: Tokenizer = get_tokenizer(tokenizer_id)  # a local dir for `tiny`
    renderer = renderers.get_renderer(RENDERER, tokenizer)
    # The renderer's prompt must be the model's own chat template, token for token.
    prompt = CONVERSATIONS[3][:2]
    assert renderer.build_generation_prompt(prompt).to_ints() == tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=False), RENDERER
    print(f"base model {base_model}, tokenizer {tokenizer_id}, renderer {RENDERER}")
    await supervised(tc, renderer)
    await rl(tc, renderer)


def main() -> int:
    for dist in ("tinker-cookbook", "tinker", "transformers", "torch"):
        print(f"{dist} {importlib.metadata.version(dist)}")
    with tempfile.TemporaryDirectory(prefix="cookbook-check-") as tmp:
        proc, http_address = start_server(Path(tmp))
        print(f"server pid {proc.pid}, http front {http_address}", flush=True)
        try:
            asyncio.run(run(f"http://{http_address}"))
        except BaseException:
            print(f"--- server log ---\n{(Path(tmp) / 'server.log').read_text()[-4000:]}",
                  file=sys.stderr)
            raise
        finally:
            proc.send_signal(signal.SIGTERM)  # drains, then exits
            try:
                rc = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    print(f"server stopped (SIGTERM), exit code {rc}")
    if rc != 0:
        return 1
    print("cookbook-check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
