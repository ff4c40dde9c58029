"""Writes tests/fixtures/hf5/: tiny models saved by transformers 5 itself, with its logits.

Run by hand, never by the tests (which import neither torch nor transformers):

    python3 -m venv /work/venv-hf5
    /work/venv-hf5/bin/pip install torch==2.13.0 'transformers>=5' safetensors numpy
    /work/venv-hf5/bin/python tests/make_hf5_fixtures.py

Each folder holds config.json and model.safetensors as `save_pretrained` writes them, and
logits.npy: transformers' fp32 logits [1, SEQ, vocab] for IDS. The sequence (20) is longer than
the llama3 fixture's original_max_position_embeddings (8), so its scaling matters; so is it than
the DeepSeek-V3 fixture's (YaRN: one of its two rope frequency pairs kept, one slowed 40x).
The DeepSeek-V3 fixtures' routers get a random e_score_correction_bias (a buffer, zeros at init).
"""

import os
import sys

import numpy as np
import torch
import transformers
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                          MixtralForCausalLM)

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf5")
V, SEQ = 64, 20
IDS = np.random.default_rng(0).integers(0, V, size=(1, SEQ)).astype(np.int64)
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)

MODELS = {
    "llama_default": (LlamaForCausalLM, LlamaConfig(**SMALL, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 10000.0})),
    # with theta 500000, head dim 8 and original max positions 8 the frequencies fall in the blended and
    # slowed bands only (none kept); tests/test_hf_rope.py covers the kept band against a numpy reference
    "llama3_scaled": (LlamaForCausalLM, LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8})),
    "mixtral_theta1e6": (MixtralForCausalLM, MixtralConfig(**{**SMALL, "intermediate_size": 16}, num_local_experts=4, num_experts_per_tok=2,
                                                           rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 1e6})),
    # DeepSeek-V3: multi-latent attention with a query latent, YaRN rope, a dense first layer, then
    # MoE layers with a shared expert, group-limited sigmoid routing and the expert bias
    "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        routed_scaling_factor=2.5, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=6,
        qk_nope_head_dim=8, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0})),
    # queries projected directly (no q_lora_rank), plain rope, every layer MoE, no groups
    "deepseek_v3_q_direct": (DeepseekV3ForCausalLM, DeepseekV3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=4,
        routed_scaling_factor=1.5, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, v_head_dim=6,
        qk_nope_head_dim=8, n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=0,
        norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def main():
    print("transformers", transformers.__version__, "torch", torch.__version__)
    only = sys.argv[1:]  # names to (re)write; all without
    for seed, (name, (cls, config)) in enumerate(MODELS.items()):
        if only and name not in only:
            continue
        torch.manual_seed(seed)
        model = cls(config).eval()
        with torch.no_grad():  # larger weights than the 0.02 init, so every position's logits differ
            for p in model.parameters():
                p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
            for buffer, b in model.named_buffers():
                if buffer.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.2)
            logits = model(torch.from_numpy(IDS)).logits.float().numpy()
        folder = os.path.join(HERE, name)
        model.save_pretrained(folder)
        np.save(os.path.join(folder, "logits.npy"), logits.astype(np.float32))
        np.save(os.path.join(folder, "ids.npy"), IDS.astype(np.int32))
        print(name, sorted(os.listdir(folder)), logits.shape)


if __name__ == "__main__":
    main()
