"""Self-cognition SFT through the native Twinkle client: the seed article's Twinkle Client
code, run against a Twinkle server.

Run (a server must be listening, e.g. `make serve` in another terminal):

    .venv/bin/python examples/sft_twinkle_client.py --base-url http://127.0.0.1:8000

Knobs: `--model` (default: the server's first served model), `--epochs`, `--steps` (stop
after this many batches in all), `--rows`, `--lr`, `--rank`, `--resume` (continue from the
newest checkpoint found on the server, as the article's commented-out line does). Prints
each step's loss and each epoch's metrics, saves a checkpoint per epoch, and writes the
loss curve to `--plot` (default `sft-loss.png`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from peft import LoraConfig

from twinkle_client import TwinkleClient, get_logger, init_twinkle_client
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset, DatasetMeta
from twinkle_client.model import MultiLoraTransformersModel

logger = get_logger()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("TWINKLE_BASE_URL",
                                                             "http://127.0.0.1:8000"))
    parser.add_argument("--api-key", default=os.environ.get("TWINKLE_API_KEY", "EMPTY_TOKEN"))
    parser.add_argument("--model", default=None,
                        help="base model id (ms:// or hf:// prefix allowed); default: the "
                             "server's first served model")
    parser.add_argument("--rows", type=int, default=500, help="data_slice=range(ROWS)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None,
                        help="stop after this many batches in all (default: every epoch)")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lora-alpha", type=float, default=8.0)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=None, help="LoRA initialisation seed")
    parser.add_argument("--resume", action="store_true",
                        help="load the newest checkpoint on the server, with its optimizer")
    parser.add_argument("--plot", type=Path, default=Path("sft-loss.png"))
    return parser.parse_args(argv)


def newest_checkpoint(client: TwinkleClient) -> str | None:
    """The article's listing loop: every run and checkpoint, oldest first, so the last
    path seen is the newest."""
    resume_path = None
    for run in client.list_training_runs():
        logger.info(run.model_dump_json(indent=2))
        for ckpt in client.list_checkpoints(run.training_run_id):
            logger.info(ckpt.model_dump_json(indent=2))
            resume_path = ckpt.twinkle_path
    return resume_path


def build_model(args: argparse.Namespace, model_id: str) -> MultiLoraTransformersModel:
    model = MultiLoraTransformersModel(model_id=model_id)
    lora_config = LoraConfig(r=args.rank, lora_alpha=args.lora_alpha,
                             target_modules="all-linear")
    model.add_adapter_to_model("default", lora_config,
                               gradient_accumulation_steps=args.grad_accum, seed=args.seed)
    model.set_template("Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=args.lr)
    model.set_lr_scheduler("LinearLR")
    return model


def train(args: argparse.Namespace, model: MultiLoraTransformersModel, model_id: str,
          resume_path: str | None = None) -> list[float]:
    """The article's loop; returns every batch's loss (token mean over answer tokens)."""
    dataset = Dataset(dataset_meta=DatasetMeta("ms://swift/self-cognition",
                                               data_slice=range(args.rows)))
    dataset.set_template("Template", model_id=model_id, max_length=args.max_length)
    dataset.map("SelfCognitionProcessor",
                init_args={"model_name": "twinkle", "model_author": "ModelScope"})
    dataset.encode(batched=True)
    dataloader = DataLoader(dataset=dataset, batch_size=args.batch_size)
    if resume_path:
        logger.info(f"Resuming training from {resume_path}")
        model.load(resume_path, load_optimizer=True)
    logger.info(model.get_train_configs())
    losses: list[float] = []
    for epoch in range(args.epochs):
        for step, batch in enumerate(dataloader):
            output = model.forward_backward(inputs=batch)
            losses.append(output.loss)
            model.clip_grad_norm(1.0)
            model.step()
            model.zero_grad()
            model.lr_step()
            print(f"epoch {epoch} step {step:3d}  loss {output.loss:.4f}", flush=True)
            if args.steps is not None and len(losses) >= args.steps:
                break
        metrics = model.calculate_metric(is_training=True)
        print(f"epoch {epoch} metrics: " + ", ".join(f"{k} {v:.4g}"
                                                    for k, v in sorted(metrics.items())),
              flush=True)
        twinkle_path = model.save(name=f"twinkle-epoch-{epoch}", save_optimizer=True)
        logger.info(f"Saved checkpoint: {twinkle_path}")
        if args.steps is not None and len(losses) >= args.steps:
            break
    return losses


def plot(losses: list[float], path: Path, title: str) -> None:
    """The loss curve as a PNG (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, marker=".")
    ax.set_xlabel("batch")
    ax.set_ylabel("cross-entropy (mean over answer tokens)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    client = init_twinkle_client(base_url=args.base_url, api_key=args.api_key)
    try:
        model_id = args.model or client.get_server_capabilities().models[0].name
        resume_path = newest_checkpoint(client) if args.resume else None
        model = build_model(args, model_id)
        losses = train(args, model, model_id, resume_path)
        print(f"loss: first batch {losses[0]:.4f}, last batch {losses[-1]:.4f}", flush=True)
        plot(losses, args.plot, f"Twinkle client SFT on {model_id}")
        print(f"loss curve written to {args.plot}", flush=True)
    finally:
        client.close()


if __name__ == "__main__":
    main()
