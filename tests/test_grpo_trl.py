"""Our GRPO / DAPO / Dr. GRPO loss and advantages against TRL's own: the same model, completions and old
log-probs through `trl.GRPOTrainer._compute_loss` (TRL 1.16, the real trainer built on CPU) and through
`policy_logprobs` + `grpo_loss`; TRL's sampled-and-scored advantages against `group_advantages`. qerl.rl keeps TRL's loss semantics without running TRL's loop (qerl/rl/DESIGN_NOTES.md says why);
this is where the two are held to each other, values and gradients."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from qerl.rl.grpo import grpo_loss  # noqa: E402
from qerl.rl.rollout import RolloutBatch, policy_logprobs  # noqa: E402

VOCAB, PROMPTS, GENERATIONS, PROMPT_LEN, COMPLETION = 64, 2, 4, 3, 6
TEMPERATURE, EPSILON, EPSILON_HIGH = 0.7, 0.2, 0.28


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<pad>")


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    model = LlamaForCausalLM(config)
    args = trl.GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=GENERATIONS,
                          num_generations=GENERATIONS, max_completion_length=COMPLETION, epsilon=EPSILON,
                          epsilon_high=EPSILON_HIGH, temperature=TEMPERATURE, use_cpu=True, report_to="none",
                          bf16=False, gradient_accumulation_steps=1)
    prompts = datasets.Dataset.from_dict({"prompt": ["w2 w3 w4"] * 8})
    t = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                        train_dataset=prompts, processing_class=_tokenizer())
    t.current_gradient_accumulation_steps = 1  # what TRL's training loop sets before each micro-batch
    return t


def _batch(seed: int):
    """Two prompts (no padding: TRL's forward takes positions from the sequence, ours from the mask) x 4
    completions of 1..6 tokens, right-padded, and random advantages."""
    g = torch.Generator().manual_seed(seed)
    n = PROMPTS * GENERATIONS
    prompts = torch.randint(2, VOCAB, (PROMPTS, PROMPT_LEN), generator=g)
    lengths = torch.randint(1, COMPLETION + 1, (n,), generator=g)
    lengths[0] = COMPLETION
    mask = (torch.arange(COMPLETION)[None, :] < lengths[:, None]).long()
    completions = torch.randint(2, VOCAB, (n, COMPLETION), generator=g) * mask
    rows = torch.arange(n) // GENERATIONS
    batch = RolloutBatch(prompts, torch.ones_like(prompts), rows, completions, mask, torch.zeros(n, COMPLETION),
                         torch.zeros(n, COMPLETION), lengths < COMPLETION)
    return batch, torch.randn(n, generator=g), g


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta, bias_correction", [(0.0, True), (0.04, True), (0.04, False)])
def test_loss_and_gradients_equal_trls(trainer, loss_type, beta, bias_correction):
    model = trainer.model
    model.train()
    seed = {"grpo": 1, "dapo": 5, "dr_grpo": 9}[loss_type] + (beta > 0) + (not bias_correction)
    batch, advantages, g = _batch(seed)
    mask = batch.completion_mask
    with torch.no_grad():
        now = policy_logprobs(model, batch, temperature=TEMPERATURE)
    # the rollout policy a little off the current one, so both clip edges are reached
    old = (now + 0.3 * torch.randn(now.shape, generator=g)) * mask
    ref = (now + 0.2 * torch.randn(now.shape, generator=g)) * mask
    trainer.loss_type = trainer.args.loss_type = loss_type
    trainer.beta = beta
    trainer.args.use_bias_correction_kl = bias_correction  # TRL's default: True (the KL term times the ratio)
    inputs = {"prompt_ids": batch.prompt_ids[batch.prompt_index], "prompt_mask": batch.prompt_mask[batch.prompt_index],
              "completion_ids": batch.completion_ids, "completion_mask": mask, "advantages": advantages,
              "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum().float()}

    model.zero_grad()
    theirs = trainer._compute_loss(model, inputs)
    theirs.backward()
    their_grads = _grads(model)

    model.zero_grad()
    logp = policy_logprobs(model, batch, temperature=TEMPERATURE)
    ours, stats = grpo_loss(logp, old, advantages, mask.float(), loss_type=loss_type, epsilon=EPSILON,
                            epsilon_high=EPSILON_HIGH, beta=beta, ref_logp=ref if beta else None,
                            use_bias_correction_kl=bias_correction, max_completion_length=COMPLETION)
    ours.backward()

    assert stats["clip_low_tokens"] > 0 and stats["clip_high_tokens"] > 0, stats  # both clip edges took part
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-7)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, their_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_equal_trls(trainer, tmp_path, scale_rewards):
    """TRL samples two prompts x 4 completions with the tiny model and scores them with a reward that varies
    inside a group; its advantages must equal group_advantages of the same rewards."""
    from qerl.rl.grpo import group_advantages

    seen: list[list[float]] = []

    def reward(completions, **kw):  # a deterministic function of the sampled words
        r = [float(sum(int(w[1:]) for w in c.split() if w[1:].isdigit()) % 7) for c in completions]
        seen.append(r)
        return r

    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2 * GENERATIONS,
                          num_generations=GENERATIONS, max_completion_length=COMPLETION, temperature=1.0, use_cpu=True,
                          report_to="none", bf16=False, scale_rewards=scale_rewards)
    prompts = ["w2 w3 w4", "w5 w6 w7"]
    sampler = trl.GRPOTrainer(model=trainer.model, reward_funcs=reward, args=args, processing_class=_tokenizer(),
                              train_dataset=datasets.Dataset.from_dict({"prompt": prompts * 4}))
    torch.manual_seed(3)
    out = sampler._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(GENERATIONS)])
    rewards = torch.tensor(seen[-1])
    assert len(set(rewards[:GENERATIONS].tolist())) > 1 and len(set(rewards[GENERATIONS:].tolist())) > 1, rewards
    torch.testing.assert_close(group_advantages(rewards, GENERATIONS, scale_rewards), out["advantages"].float(),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, warmup", [("cosine", 0.1), ("linear", 3), ("constant_with_warmup", 0.25),
                                          ("constant", 0.0)])
def test_learning_rate_schedule_equals_the_trainers(trainer, tmp_path, kind, warmup):
    """The learning rate at every update equals what TRL's trainer (the HF Trainer's scheduler) gives for the
    same lr_scheduler_type, warmup_steps (steps, or a ratio below 1) and max_steps."""
    from qerl.rl.grpo import GRPOSettings
    from qerl.rl.trainer import make_optimizer

    steps = 20
    for p in trainer.model.parameters():  # no gradients: the optimisers' steps below leave the shared model as it is
        p.grad = None
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=GENERATIONS, num_generations=GENERATIONS,
                          use_cpu=True, report_to="none", bf16=False, learning_rate=3e-4, lr_scheduler_type=kind,
                          warmup_steps=warmup, max_steps=steps)
    theirs = trl.GRPOTrainer(model=trainer.model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                             args=args, processing_class=_tokenizer(),
                             train_dataset=datasets.Dataset.from_dict({"prompt": ["w2 w3"] * 8}))
    theirs.create_optimizer_and_scheduler(num_training_steps=steps)
    settings = GRPOSettings(learning_rate=3e-4, lr_scheduler_type=kind, warmup_steps=warmup, max_steps=steps,
                            num_generations=GENERATIONS, per_device_train_batch_size=GENERATIONS)
    optimizer, ours = make_optimizer(trainer.model, settings)
    got, want = [], []
    for _ in range(steps):
        got.append(ours.get_last_lr()[0])
        want.append(theirs.lr_scheduler.get_last_lr()[0])
        optimizer.step()
        theirs.optimizer.step()
        ours.step()
        theirs.lr_scheduler.step()
    assert got == pytest.approx(want, rel=1e-12, abs=0.0)
    assert kind == "constant" or min(got) < max(got)  # the schedule moved


def test_weight_decay_groups_equal_the_trainers(trainer, tmp_path):
    """With trainable norms (the paper's LoRA + norms setting) the HF Trainer under TRL leaves norm weights and
    biases undecayed; make_optimizer's groups must hold the same parameters at the same weight decay."""
    import copy

    from qerl.nn.lora import LoraSettings, apply_lora
    from qerl.rl.grpo import GRPOSettings
    from qerl.rl.trainer import make_optimizer

    model = apply_lora(copy.deepcopy(trainer.model), LoraSettings(r=4, train_norms=True), seed=0)
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=GENERATIONS, num_generations=GENERATIONS,
                          use_cpu=True, report_to="none", bf16=False, weight_decay=0.1)
    theirs = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                             processing_class=_tokenizer(),
                             train_dataset=datasets.Dataset.from_dict({"prompt": ["w2 w3"] * 8}))
    theirs.create_optimizer()
    ours, _ = make_optimizer(model, GRPOSettings(weight_decay=0.1, num_generations=GENERATIONS,
                                                 per_device_train_batch_size=GENERATIONS))

    def by_decay(opt):
        return {g["weight_decay"]: {id(p) for p in g["params"]} for g in opt.param_groups if g["params"]}

    got, want = by_decay(ours), by_decay(theirs.optimizer)
    assert set(got) == set(want) == {0.0, 0.1}
    assert got == want
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("lora_" not in names[i] for i in got[0.0]) and all("lora_" in names[i] for i in got[0.1])


@pytest.mark.parametrize("max_len, buffer", [(16, 4), (16, 1), (2048, 512), (7, 6)])
def test_overlong_penalty_equals_trls_soft_overlong_punishment(max_len, buffer):
    """DAPO's soft overlong punishment (`overlong_buffer_length`) against TRL's reward function of the same name,
    on every completion length from empty to past the cap. TRL counts a completion's token ids (its stop token
    included), as `RolloutBatch.lengths` counts the generated tokens."""
    from trl.rewards import get_soft_overlong_punishment

    from qerl.rl.grpo import overlong_penalty

    lengths = list(range(max_len + 3))
    want = get_soft_overlong_punishment(max_completion_len=max_len, soft_punish_cache=buffer)(
        [[5] * n for n in lengths])
    got = overlong_penalty(torch.tensor(lengths), max_len, buffer).tolist()
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert min(got) == -1.0 and got[max_len - buffer] == 0.0 and got[max_len - buffer + 1] < 0.0
