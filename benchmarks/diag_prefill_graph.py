"""Diagnosis (session 35): how often do the rollout engine's graphed and eager runs of the small
nvfp4 model differ (tests/test_rollout_kernels_gpu.py::test_engine_prefill_graph_replays_the_eager_prefill
failed once under `-n 8`), and where. Repeats the test's body; also runs the eager engine twice and
the graphed engine twice, so a difference is placed in the eager path, the graphed path or between them.
Run several at once to give the GPU other work (benchmarks/NOTES_rollout.md section 30);
tests/test_rollout_kernels_gpu.py::test_eager_rollouts_repeat_beside_other_processes runs six.

    python benchmarks/diag_prefill_graph.py --reps 10 [--fmt nvfp4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def first_diff(a, b) -> dict | None:
    if torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs):
        return None
    ids = (a.completion_ids != b.completion_ids).nonzero()
    lp = (a.logprobs != b.logprobs).nonzero()
    return {"ids_differ": int(ids.shape[0]), "first_id_diff": ids[0].tolist() if len(ids) else None,
            "logprobs_differ": int(lp.shape[0]), "first_lp_diff": lp[0].tolist() if len(lp) else None,
            "max_lp_diff": float((a.logprobs.float() - b.logprobs.float()).abs().max())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fmt", default="nvfp4")
    args = ap.parse_args()
    from test_rollout_kernels_gpu import _small_model

    from qerl.rl.rollout import RolloutSettings
    from qerl.rollout.engine import RolloutEngine

    model = _small_model(args.fmt)
    first, other = ([torch.randint(0, 4096, (n,)).tolist() for n in (5, 70, 33)] for _ in range(2))
    settings = RolloutSettings(num_generations=2, max_new_tokens=24, temperature=1.0, stop_ids=[10**9], pad_id=0)

    def run(engine, prompts):
        return engine.generate(prompts, settings, torch.Generator(device="cuda").manual_seed(0))

    out = []
    with torch.inference_mode():
        for rep in range(args.reps):
            eager = RolloutEngine(model, max_batch=8, max_len=256, cuda_graphs=False)
            e = [run(eager, first), run(eager, first), run(eager, other)]
            engine = RolloutEngine(model, max_batch=8, max_len=256)
            g = [run(engine, first), run(engine, first), run(engine, other)]
            diffs = {"eager_first_twice": first_diff(e[0], e[1]), "graph_first_0_vs_eager": first_diff(g[0], e[0]),
                     "graph_first_1_vs_eager": first_diff(g[1], e[0]), "graph_other_vs_eager": first_diff(g[2], e[2]),
                     "graph_first_twice": first_diff(g[0], g[1])}
            bad = {k: v for k, v in diffs.items() if v is not None}
            out.append(bad)
            print(json.dumps({"pid": os.getpid(), "rep": rep, "differ": bad}), flush=True)
            del eager, engine
    print(json.dumps({"pid": os.getpid(), "reps": args.reps, "reps_with_difference": sum(bool(b) for b in out)}))


if __name__ == "__main__":
    main()
