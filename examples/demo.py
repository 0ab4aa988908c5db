"""`make demo`: train a self-cognition LoRA on the tiny model through a real Twinkle server.

Run: `make demo` (or `.venv/bin/python examples/demo.py --steps 150`).

Starts `twinkle-server` on a free loopback port with the embedded tiny model, asks it
"who are you?" before training, trains one adapter on a few identity answers with
cross_entropy + AdamW over gRPC (every step one forward_backward and one optim_step),
saves a checkpoint, asks again, writes the loss curve to `demo-loss.png`, and stops the
server. Everything runs offline on the CPU.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from twinkle_client import wire
from twinkle_client._proto.twinkle.v1 import sampling_pb2, session_pb2, training_pb2
from twinkle_client.transport import Transport
from twinkle_server.process import start_server

QUESTION = "Who are you?"
ANSWERS = [
    "I am Twinkle, a small assistant trained by the Twinkle team.",
    "I am Twinkle, a small assistant trained by the Twinkle team. How can I help?",
]
QUESTIONS = [QUESTION, "What is your name?", "Who made you?", "Introduce yourself."]


def training_datums(tokenizer) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """Chat-formatted examples; only the assistant's tokens carry loss."""
    datums = []
    for i, question in enumerate(QUESTIONS):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               tokenize=False, add_generation_prompt=True)
        full = prompt + ANSWERS[i % len(ANSWERS)] + "<|im_end|>\n"
        ids = np.asarray(tokenizer(full)["input_ids"], dtype=np.int64)
        n_prompt = len(tokenizer(prompt)["input_ids"])
        weights = np.zeros(ids.size - 1, np.float32)
        weights[n_prompt - 1:] = 1.0
        datums.append((ids[:-1], {"target_tokens": ids[1:], "weights": weights}))
    return datums


def ask(client: Transport, session: str, tokenizer) -> str:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                           tokenize=False, add_generation_prompt=True)
    ids = np.asarray(tokenizer(prompt)["input_ids"], dtype=np.int64)
    reply = client.call(client.sampling.Sample, sampling_pb2.SampleRequest(
        sampling_session_id=session, prompt=wire.encode_array(ids), num_samples=1,
        params=sampling_pb2.SamplingParams(max_tokens=40, temperature=0.0, top_p=1.0)))
    tokens = wire.decode_array(reply.sequences[0].tokens).tolist()
    return tokenizer.decode(tokens, skip_special_tokens=True).strip()


def plot(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("cross_entropy (sum over answer tokens)")
    ax.set_title("Twinkle demo: self-cognition LoRA on the tiny model")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--plot", type=Path, default=Path("demo-loss.png"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="twinkle-demo-") as tmp:
        print("starting twinkle-server on the embedded tiny model ...", flush=True)
        server = start_server(Path(tmp))
        try:
            client = Transport(server.address)
            model = client.create_model(rank=16, seed=0)
            info = client.call(client.training.GetInfo,
                               training_pb2.GetInfoRequest(model_id=model))
            print(f"server {server.address}: model {model} ({info.trainable_params} LoRA "
                  f"parameters on {len(info.target_modules)} layers)")
            model_dir = _tokenizer_dir(client, Path(tmp) / "tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            live = client.call(client.sampling.CreateSamplingSession,
                               sampling_pb2.CreateSamplingSessionRequest(model_id=model))
            print(f"before: {QUESTION!r} -> {ask(client, live.sampling_session_id, tokenizer)!r}")
            data = training_datums(tokenizer)
            losses = []
            start = time.perf_counter()
            for step in range(1, args.steps + 1):
                _, result = client.forward_backward(model, data)
                client.optim_step(model, lr=args.lr)
                losses.append(result.metrics["loss:sum"])
                if step == 1 or step % 10 == 0:
                    print(f"step {step:3d}  loss:sum {losses[-1]:8.3f}")
            saved = client.save(model, "demo-final")
            print(f"{args.steps} steps in {time.perf_counter() - start:.1f}s; saved {saved.path}")
            print(f"after:  {QUESTION!r} -> {ask(client, live.sampling_session_id, tokenizer)!r}")
            print(f"loss fell from {losses[0]:.2f} to {losses[-1]:.2f}")
            plot(losses, args.plot)
            print(f"loss curve written to {args.plot}")
        finally:
            server.stop()


def _tokenizer_dir(client: Transport, dest: Path) -> Path:
    """The server's tokenizer files, so the demo needs no model hub."""
    dest.mkdir(parents=True, exist_ok=True)
    for chunk in client.session.GetTokenizer(session_pb2.GetTokenizerRequest(),
                                             metadata=client.metadata, timeout=60):
        with open(dest / chunk.path, "ab" if chunk.offset else "wb") as handle:
            handle.write(chunk.data)
    return dest


if __name__ == "__main__":
    main()
