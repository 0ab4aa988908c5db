"""The benches' FLOP count: what it says it counts, from the config."""

from __future__ import annotations

from transformers import Qwen3Config

from bench.flops import ModelFlops

CONFIG = Qwen3Config(hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     vocab_size=500)


def test_a_tokens_forward_counts_every_linear_layer_the_decoders_adapters_and_attention():
    flops = ModelFlops.of(CONFIG, lora_rank=8)
    layer = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 192), (64, 192), (192, 64)]
    linears = layer * 3 + [(64, 500)]
    assert flops.linear == sum(2 * i * o for i, o in linears)
    # 'all-linear' adapts every decoder linear layer, not the output layer.
    assert flops.lora == sum(2 * 8 * (i + o) for i, o in layer * 3)
    # Scores and the weighted sum: 2 * q_dim each per attended position, per layer.
    assert flops.forward(10) - flops.forward(9) == 4 * 64 * 3


def test_a_sequence_is_its_tokens_each_attending_to_all_before_it_and_itself():
    flops = ModelFlops.of(CONFIG, lora_rank=8)
    assert flops.forward_sequence(5, 7) == sum(flops.forward(5 + t + 1) for t in range(7))
    assert flops.forward_sequence(5, 0) == 0



def test_a_sample_request_prefills_its_prompt_once_and_feeds_all_but_each_last_token():
    flops = ModelFlops.of(CONFIG, lora_rank=8)
    assert flops.sampled(5, [3, 1]) == (flops.forward_sequence(0, 5)
                                        + flops.forward_sequence(5, 2))


def test_decode_attention_reads_each_layers_keys_and_values_shared_columns_once_a_group():
    flops = ModelFlops.of(CONFIG, lora_rank=8)
    # 3 layers x (keys + values) x 2 KV heads x 16 dims x 4 bytes, per column read.
    column = 3 * 2 * 2 * 16 * 4
    assert flops.decode_read(groups=2, shared=10, rows=8, own=5, itemsize=4) == \
        column * (2 * 10 + 8 * 5)
