#!/usr/bin/env python3
"""PyTorch's side of `kiln bench gpt2`: greedy generation with a growing sequence.

The same decoder as the zoo's models::GPT (nanoGPT's model.py: pre-LayerNorm blocks, causal
scaled_dot_product_attention, tanh-GELU MLP, tied lm_head), the same default config (4 layers,
4 heads, 128 channels, vocabulary 1024), random weights; --tokens new tokens from a random prompt
of --prompt tokens, each step running the whole sequence (no KV cache). Modes:
  eager; static = torch.compile(dynamic=False) (a compile per length until the cache limit);
  dynamic = torch.compile(dynamic=None) (automatic dynamic); add ",ro" for
  mode="reduce-overhead" (dynamic-ro: CUDA graphs per size).
Per mode: tokens/s over the first generation (compiles included) and over a second one (warm),
unique graphs from torch._dynamo's counters, and the first generation's seconds beyond the warm
one's (what compiling cost).
Usage: torch_gpt2.py --device cuda [--tokens 64] [--prompt 8] [--modes eager,static,dynamic,dynamic-ro]
Prints one JSON object; exits 3 when torch is not installed.
"""
import argparse
import json
import math
import sys
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as e:
    print(json.dumps({"error": f"baseline unavailable: {e}"}))
    sys.exit(3)


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def generate(fwd, idx, tokens):
    for _ in range(tokens):
        logits = fwd(idx)
        nxt = logits[:, -1, :].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], 1)
    return idx.cpu()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--modes", default="eager,static,dynamic")
    a = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device(a.device)
    model = GPT(a.vocab, a.prompt + a.tokens, a.layers, a.heads, a.embd).to(dev).eval()
    prompt = torch.randint(a.vocab, (1, a.prompt), device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    result = {"model": "gpt2", "device": a.device, "torch": torch.__version__, "prompt": a.prompt,
              "new_tokens": a.tokens, "config": {"n_layer": a.layers, "n_head": a.heads, "n_embd": a.embd,
                                                 "vocab_size": a.vocab}, "modes": {}}
    eager_warm = None
    with torch.no_grad():
        for mode in a.modes.split(","):
            torch._dynamo.reset()
            from torch._dynamo.utils import counters
            counters.clear()
            kwargs = {}
            if mode.endswith("-ro"):
                kwargs["mode"] = "reduce-overhead"
            base = mode.removesuffix("-ro")
            if base == "eager":
                fwd = model
            elif base == "static":
                fwd = torch.compile(model, dynamic=False, **kwargs)
            else:
                fwd = torch.compile(model, dynamic=None, **kwargs)
            sync()
            t0 = time.perf_counter()
            generate(fwd, prompt, a.tokens)
            sync()
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            generate(fwd, prompt, a.tokens)
            sync()
            warm = time.perf_counter() - t0
            if base == "eager":
                eager_warm = warm
            # The first generation's extra time over a warm one: compiles, recompiles and CUDA
            # graph recordings (torch._dynamo's compile_times() has no stable raw form to sum).
            m = {"tokens_per_s": a.tokens / first, "tokens_per_s_warm": a.tokens / warm,
                 "unique_graphs": counters["stats"].get("unique_graphs", 0),
                 "first_minus_warm_seconds": first - warm}
            if eager_warm:
                m["warm_speedup_vs_eager"] = eager_warm / warm
            result["modes"][mode] = m
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
