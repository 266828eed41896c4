"""PyTorch's LayerNorm backward (dx, dgamma, dbeta) GPU time at the shapes of
norm_bwd_variants.cu, bf16, for comparison (one GPU).

    python scripts/experiments/torch_norm_bwd.py
"""
import torch

for rows in (1024, 2048, 4096, 8192):
    out = []
    for cols in (1024, 2048, 4096):
        x = torch.randn(rows, cols, dtype=torch.bfloat16, device="cuda")
        dy = torch.randn_like(x)
        g = torch.randn(cols, dtype=torch.bfloat16, device="cuda")
        b = torch.randn_like(g)
        _, mu, rs = torch.ops.aten.native_layer_norm(x, [cols], g, b, 1e-5)
        f = lambda: torch.ops.aten.native_layer_norm_backward(dy, x, [cols], mu, rs, g, b, [True, True, True])  # noqa: E731
        for _ in range(5):
            f()
        graph = torch.cuda.CUDAGraph()  # 20 calls replayed: the GPU's time, not the launches'
        with torch.cuda.graph(graph):
            for _ in range(20):
                f()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        s.record()
        for _ in range(5):
            graph.replay()
        e.record()
        torch.cuda.synchronize()
        out.append(f"{rows}x{cols} torch {s.elapsed_time(e) * 1e3 / 100:.1f} us")
    print(" | ".join(out))
