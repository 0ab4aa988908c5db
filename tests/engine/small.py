"""A small random Qwen3 for the sampling tests: no router (every row on the base), token
ids as letters for stop strings, and 299 as its EOS."""

from __future__ import annotations

import contextlib

import torch

EOS = 299


def route(rows):
    return contextlib.nullcontext()


def decode(ids):
    return "".join(chr(ord("a") + i % 26) for i in ids)


def build(**config):
    """The 2-layer, 300-token model of random weights (seeded), with `config` overrides."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**{
        "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "max_position_embeddings": 512, **config})).eval()
