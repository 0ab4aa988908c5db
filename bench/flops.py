"""Model FLOPs of a Qwen3-shaped base with one LoRA adapter, counted from its config: the
one count every bench that states a utilisation uses (`bench.limit` against this
machine's GEMM rate, `bench.gpu` against a device's matmul peak).

- a linear layer of `i` inputs and `o` outputs: 2*i*o per token forward, and its LoRA
  adapter of rank r 2*r*(i+o) more (every decoder linear layer, not the output layer:
  an `'all-linear'` adapter, as PEFT and the engine mean it);
- attention: 4*q_dim per attended position per layer forward (scores and the weighted
  sum, 2*q_dim each), a token attending to every position before it and itself;
- sampling: one forward per prompt token (the prefill, once per request) and per sampled
  token but the last (drawn, never fed);
- decode attention's reads (`decode_read`): it is bound by reading the cache, not by
  its FLOPs, so benches weigh it in bytes against the machine's read rate;
- training (forward_backward): the forward, then the backward through the activations
  (the same FLOPs again: the base is frozen, so no weight gradients but the adapter's,
  2*r*(i+o) more per token) and attention's backward (twice its forward).

Work a run repeats is not counted (a forward activation checkpointing runs again, a
pass in pieces): a utilisation from this count is the useful share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFlops:
    """FLOP counts of one model with one adapter, from its config (module docstring)."""

    linears: tuple[tuple[int, int], ...]   # (inputs, outputs) of the decoder's linears
    head: tuple[int, int]                  # the output layer's
    lora_rank: int
    layers: int
    q_dim: int
    kv_dim: int

    @classmethod
    def of(cls, config, lora_rank: int) -> ModelFlops:
        h, inter = config.hidden_size, config.intermediate_size
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        layer = ((h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h))
        return cls(layer * config.num_hidden_layers, (h, config.vocab_size), lora_rank,
                   config.num_hidden_layers, q, kv)

    @property
    def linear(self) -> int:
        """Forward FLOPs of the base's linear layers, the output layer's included, per
        token."""
        return sum(2 * i * o for i, o in (*self.linears, self.head))

    @property
    def lora(self) -> int:
        """Forward FLOPs of the adapter, per token: every decoder linear layer, not the
        output layer (`'all-linear'`, as PEFT means it)."""
        return sum(2 * self.lora_rank * (i + o) for i, o in self.linears)

    def forward(self, attended: int) -> int:
        """One token's forward, attending to `attended` positions."""
        return self.linear + self.lora + 4 * self.q_dim * self.layers * attended

    def forward_sequence(self, start: int, length: int) -> int:
        """Forwards of `length` tokens following `start` earlier ones (each attends to
        every position before it and itself)."""
        attended = length * start + length * (length + 1) // 2
        return length * (self.linear + self.lora) + 4 * self.q_dim * self.layers * attended

    def train_sequence(self, length: int) -> int:
        """forward_backward of one datum of `length` tokens."""
        forward = self.forward_sequence(0, length)
        attention = forward - length * (self.linear + self.lora)
        return forward + length * (self.linear + 2 * self.lora) + 2 * attention

    def sampled(self, prompt: int, lengths: Sequence[int]) -> int:
        """One sample request: its prompt's prefill (once, its samples share it), then
        each sample's forwards, one per token drawn after the prefill's, at `lengths`
        tokens drawn (the last token drawn is never fed)."""
        return self.forward_sequence(0, prompt) + sum(
            self.forward_sequence(prompt, length - 1) for length in lengths)

    def decode_read(self, groups: int, shared: int, rows: int, own: int,
                    itemsize: int) -> int:
        """Bytes a decode step's attention reads from the cache: keys and values of every
        layer, `shared` columns once for each of `groups` requests (their samples' prompt,
        `KVBatch.shared_prefix`) and `own` columns for each of `rows` rows."""
        return 2 * self.layers * self.kv_dim * itemsize * (groups * shared + rows * own)
