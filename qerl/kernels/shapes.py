"""Linear-layer shapes of the Qwen2.5 Instruct models, as the fused checkpoints hold them.

Each entry is (model, layer, N, K) for y[M, N] = x[M, K] @ W[N, K]^T: q/k/v fused, o, gate/up
fused, down. Used by tests/test_kernels_gpu.py and benchmarks/bench_w4a16.py.
"""

from __future__ import annotations

# hidden, intermediate, attention heads, kv heads (head_dim 128 for all four)
QWEN25 = {
    "3B": (2048, 11008, 16, 2),
    "7B": (3584, 18944, 28, 4),
    "14B": (5120, 13824, 40, 8),
    "32B": (5120, 27648, 40, 8),
}
HEAD_DIM = 128
LAYERS = ("qkv", "o", "gate_up", "down")
M_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)


def linear_shapes(models=tuple(QWEN25)) -> list[tuple[str, str, int, int]]:
    out = []
    for model in models:
        hidden, inter, heads, kv = QWEN25[model]
        out += [
            (model, "qkv", (heads + 2 * kv) * HEAD_DIM, hidden),
            (model, "o", hidden, heads * HEAD_DIM),
            (model, "gate_up", 2 * inter, hidden),
            (model, "down", hidden, inter),
        ]
    return out
