"""RL for LLMs over frozen 4-bit weights: GRPO / DAPO with LoRA and AQN.

- `qerl.rl.grpo`     GRPOSettings (TRL GRPOConfig names) and the loss pieces (pure functions).
- `qerl.rl.rollout`  batched sampling with per-token logprobs/entropies, policy logprobs.
- `qerl.rl.trainer`  `train(...)`: the loop, checkpoints, resume, metrics.
- `qerl.rl.rewards`  reward functions `(completions, **kwargs) -> list[float]`.
- `qerl.rl.arith`    a generated arithmetic word-problem task (learnable by a 135M model).

Nothing is imported here, so `import qerl.rl` stays light; see DESIGN_NOTES.md.
"""
