"""TransformerLayer's and MultiheadAttention's host time per step on the CPU
against the same work composed by hand, where host work is all there is
(16 tokens, hidden 32, ffn 128, 2 heads, float32, one intra-op thread).

    PYTHONPATH=. python scripts/experiments/tl_host_cpu.py [--rounds 60] [--steps 10] [--which tl,fused,mha]

Pairs: TransformerLayer (TE's default split qkv parameters) and with
fuse_qkv_params=True against ComposedBlock (benchmarks/blocks.py's OurBlock);
MultiheadAttention against the same three layers composed by hand
(LayerNormLinear, DotProductAttention, Linear) and against torch.nn's
attention half (benchmarks/blocks.py's TorchAttention). Modes: fwd+bwd with
gradients accumulating (as bench --tp1), fwd+bwd with the gradients dropped
first (as a training step), and a no-grad forward. Each figure is the least
per-thread CPU time per step over the rounds (a round: --steps steps of one,
then of the other, the order alternating), in µs; ratio = first / second.
"""
import argparse
import time

import torch

import transformer_engine_c as tec
from transformer_engine_c.benchmarks.blocks import OurBlock
from transformer_engine_c.benchmarks.tp1 import build

T, H, N, HEADS = 16, 32, 128, 2


class ComposedAttention(torch.nn.Module):
    """MultiheadAttention's work composed by hand of the package's layers."""

    def __init__(self, dtype, device):
        super().__init__()
        self.qkv = tec.LayerNormLinear(H, 3 * H, params_dtype=dtype, device=device)
        self.attn = tec.DotProductAttention(HEADS, H // HEADS, attn_mask_type="causal")
        self.proj = tec.Linear(H, H, params_dtype=dtype, device=device)

    def forward(self, x):
        s, b, h = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, HEADS, -1).unbind(2)
        return self.proj(self.attn(q, k, v).view(s, b, h))


def modes(m, x, dy, steps):
    params = list(m.parameters())

    def fwd_bwd():
        for _ in range(steps):
            m(x).backward(dy)

    def fwd_bwd_zero():
        for _ in range(steps):
            x.grad = None
            for p in params:
                p.grad = None
            m(x).backward(dy)

    def no_grad():
        with torch.no_grad():
            for _ in range(steps):
                m(x)
    return {"fwd+bwd": fwd_bwd, "fwd+bwd (grads dropped)": fwd_bwd_zero, "no_grad": no_grad}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--which", default="tl,fused,mha")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype, dev = torch.float32, torch.device("cpu")
    which = args.which.split(",")
    kw = dict(hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, device=dev)
    pairs = []
    if "tl" in which:
        pairs.append(("TransformerLayer / ComposedBlock", tec.TransformerLayer(H, N, HEADS, **kw),
                      OurBlock(tec, H, HEADS, dtype, dev, ffn=N)))
    if "fused" in which:
        pairs.append(("TransformerLayer(fused qkv) / ComposedBlock",
                      tec.TransformerLayer(H, N, HEADS, fuse_qkv_params=True, qkv_weight_interleaved=False, **kw),
                      OurBlock(tec, H, HEADS, dtype, dev, ffn=N)))
    if "mha" in which:
        mha, torch_half = build(tec, "MultiheadAttention", H, N, dtype, dev)
        pairs.append(("MultiheadAttention / composed half", mha, ComposedAttention(dtype, dev)))
        pairs.append(("MultiheadAttention / torch.nn half", mha, torch_half))
    x = torch.randn(T, 1, H, dtype=dtype, device=dev, requires_grad=True)
    dy = torch.randn(T, 1, H, dtype=dtype, device=dev)
    print(f"{'pair':44s} {'mode':24s} {'first':>8s} {'second':>8s} {'ratio':>6s}")
    for name, a, b in pairs:
        fa, fb = modes(a, x, dy, args.steps), modes(b, x, dy, args.steps)
        for mode in fa:
            fns = (fa[mode], fb[mode])
            for f in fns:
                f()
            best = [float("inf")] * 2
            for r in range(args.rounds):
                for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                    t0 = time.thread_time()
                    fns[i]()
                    best[i] = min(best[i], (time.thread_time() - t0) / args.steps * 1e6)
            print(f"{name:44s} {mode:24s} {best[0]:8.1f} {best[1]:8.1f} {best[0] / best[1]:6.3f}", flush=True)


if __name__ == "__main__":
    main()
