"""Standalone timing of the lora_in_gemv_prototype.patch kernel (apply the patch first):
    PYTHONPATH=. python benchmarks/patches/lora_in_gemv_standalone_bench.py out.json
7B's four LoRA groups at M = 8, r32 / r64: the Gluon GEMV alone (4 / 3 programs per SM, 3 with
maxnreg 80) and with the LoRA in the launch, each a CUDA graph of 20 launches, median of 5
replays, us per launch (results/rollout_ablate/lora_in_gemv_standalone.json)."""
import json
import sys

import torch

from qerl.formats import quantize_weight
from qerl.kernels import prepare
from qerl.kernels import w4a16_gluon as G

shapes = {"qkv": (3584, [3584, 512, 512]), "o": (3584, [3584]), "gate_up": (3584, [18944, 18944]),
          "down": (18944, [3584])}
res = []
for name, (k, sizes) in shapes.items():
    n = sum(sizes)
    edges = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    bounds = (edges[0] if len(sizes) > 1 else n, edges[1] if len(sizes) > 2 else n)
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    st = prepare("nvfp4", quantize_weight(w, "nvfp4"))
    x = torch.randn(8, k, device="cuda").bfloat16()
    for rank in (32, 64):
        a = (torch.randn(len(sizes) * rank, k, device="cuda") * k ** -0.5).bfloat16()
        b = (torch.randn(n, rank, device="cuda") * 0.1).bfloat16()
        ws = G.lora_workspace(k, a.shape[0], "cuda")
        row = {"layer": name, "rank": rank}
        for label, kw, cfg in (("base4", {}, {}), ("base3", {}, {"PER_SM": 3}),
                               ("base3r80", {}, {"PER_SM": 3, "maxnreg": 80}),
                               ("lora", {"lora": (a, b, bounds, rank, ws)}, {"PER_SM": 3})):
            for _ in range(3):
                G.forward(x, st, config=cfg, **kw)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(20):
                    G.forward(x, st, config=cfg, **kw)
            g.replay()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = []
            for _ in range(5):
                e0.record()
                g.replay()
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) * 1000 / 20)
            row[label] = round(sorted(ts)[2], 2)
        print(row, flush=True)
        res.append(row)
json.dump(res, open(sys.argv[1], "w"), indent=1)
