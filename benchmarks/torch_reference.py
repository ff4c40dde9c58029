"""Workload W as a nanoGPT-style PyTorch train step under `torch.compile`: the reference that issue
15 (item 6) compares `python -m mlm_jax.train` with. Not part of mlm_jax (no PyTorch at run time):
run it with a Python that has torch, e.g.

    python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch==2.13.0 numpy
    /tmp/torchvenv/bin/python benchmarks/torch_reference.py [--steps 15] [--no-compile]

`benchmarks/workload_w.py --torch-python /tmp/torchvenv/bin/python` runs it beside the JAX figures.

W: 4 layers, hidden 256, 8 heads, ffn 1024, vocab 8192, seq 256, batch 8, fp32, AdamW (lr 1e-3,
betas 0.9/0.999, weight decay 0.01 on matrices), gradient clipping at 1.0, no dropout, tied
embedding, learned positions, pre-LN GPT-2 blocks with exact GELU, causal
`scaled_dot_product_attention`: the model mlm_jax builds from the W flags. Prints one JSON line:
tokens/s (the median step of --steps timed steps after 3 warm-up steps), step ms, torch version,
threads.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQ, BATCH = 4, 256, 8, 1024, 8192, 256, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x):  # x [b, s, d]
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(HIDDEN, dim=2)
        q, k, v = (t.view(b, s, HEADS, d // HEADS).transpose(1, 2) for t in (q, k, v))  # [b, h, s, k]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, labels):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.embed.weight.T  # tied LM head
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--no-compile", action="store_true", help="eager PyTorch instead of torch.compile")
    ap.add_argument("--profile", action="store_true", help="also 3 steps under torch.profiler: self CPU "
                    "time per op, ms per step, in the JSON line's \"profile\"")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    loss_fn = model if args.no_compile else torch.compile(model)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step():
        loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    t0 = time.perf_counter()
    for _ in range(3):
        first = step()
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        last = step()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    profile = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        profile = [(e.key, e.self_cpu_time_total / 3e3) for e in ops[:40]]
    print(json.dumps({"impl": "torch eager" if args.no_compile else "torch.compile", "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "tokens_per_s": BATCH * SEQ / step_s,
                      "step_ms": 1000 * step_s, "warmup_s": warm_s, "loss_first": first, "loss_last": last,
                      "finite": math.isfinite(last),
                      **({"profile": profile} if profile else {})}))


if __name__ == "__main__":
    main()
