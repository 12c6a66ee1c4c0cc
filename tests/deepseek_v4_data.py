"""Tiny DeepSeek-V4 models for the tests (built from a config here: nothing is downloaded)."""

import torch
from transformers import DeepseekV4Config

MLP_TYPES = ["hash_moe", "moe"]  # both routers


def tiny_config(hc_mult=4, iters=20, layers=2, hidden=64, vocab=97, **kwargs):
    return DeepseekV4Config(
        vocab_size=vocab,
        hidden_size=hidden,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=32,
        o_lora_rank=32,
        o_groups=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        sliding_window=8,
        qk_rope_head_dim=8,
        hc_mult=hc_mult,
        hc_sinkhorn_iters=iters,
        num_nextn_predict_layers=0,
        max_position_embeddings=256,
        mlp_layer_types=MLP_TYPES[:layers],
        experts_implementation="eager",
        **kwargs,  # the loop over experts runs in fp64 too (the oracle)
    )


def step_ids() -> torch.Tensor:
    """A fixed batch of token ids ``[2, 12]`` for one training step."""
    return torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
