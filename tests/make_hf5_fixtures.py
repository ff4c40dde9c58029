"""Writes tests/fixtures/hf5/: tiny models saved by transformers 5 itself, with its logits.

Run by hand, never by the tests (which import neither torch nor transformers):

    python3 -m venv /work/venv-hf5
    /work/venv-hf5/bin/pip install torch==2.13.0 'transformers>=5' safetensors numpy
    /work/venv-hf5/bin/python tests/make_hf5_fixtures.py

Each folder holds config.json and model.safetensors as `save_pretrained` writes them, and
logits.npy: transformers' fp32 logits [1, SEQ, vocab] for IDS. The sequence (20) is longer than
the llama3 fixture's original_max_position_embeddings (8), so its scaling matters.
"""

import os

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

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
}


def main():
    print("transformers", transformers.__version__, "torch", torch.__version__)
    for seed, (name, (cls, config)) in enumerate(MODELS.items()):
        torch.manual_seed(seed)
        model = cls(config).eval()
        with torch.no_grad():  # larger weights than the 0.02 init, so every position's logits differ
            for p in model.parameters():
                p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
            logits = model(torch.from_numpy(IDS)).logits.float().numpy()
        folder = os.path.join(HERE, name)
        model.save_pretrained(folder)
        np.save(os.path.join(folder, "logits.npy"), logits.astype(np.float32))
        np.save(os.path.join(folder, "ids.npy"), IDS.astype(np.int32))
        print(name, sorted(os.listdir(folder)), logits.shape)


if __name__ == "__main__":
    main()
