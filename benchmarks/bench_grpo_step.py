"""One full GRPO step (rollout, log-probs, backward, optimizer) per model, format and batch:
seconds per phase and peak GPU memory, LoRA over bf16 / nf4 (QLoRA) / nvfp4 (QeRL) bases.

Run on a CUDA GPU:

    python benchmarks/bench_grpo_step.py --out-dir benchmarks/results \
        --models qwen2.5-7b qwen2.5-14b --formats bf16 nf4 nvfp4 --batches 2 4 8
    python benchmarks/bench_grpo_step.py --out-dir benchmarks/results --append \
        --models qwen2.5-32b --formats nvfp4 bf16 --batches 1 --micro-batch 2
    python benchmarks/bench_grpo_step.py --combine call1/memory.json call2/memory.json --out-dir benchmarks/results
    # on a CPU, tiny and slow, to try the code path:
    python benchmarks/bench_grpo_step.py --device cpu --models tiny-llama --batches 1 \
        --generations 2 --prompt-len 8 --completion 8 --rank 4 --steps 1 --out-dir /tmp/bench

What one configuration runs, each in its own process (so one that runs out of memory is recorded
as "oom" and the next starts clean):
- the model is built directly in its format, layer by layer (`qerl.build.build_model`,
  random-initialised Qwen2.5-*-shaped weights: honest for speed and memory, not quality; no bf16
  copy of a 4-bit model ever exists);
- LoRA adapters of --rank on all seven linears of every layer (`qerl.rl.trainer.prepare_policy`,
  gradient checkpointing as --gradient-checkpointing says, on by default, of every layer or, with
  --checkpoint-layers auto, of all but the layers the memory plan finds room for; off, the training
  forwards share each group's prompt as the trainer's do); AQN on for nvfp4 (QeRL), off for the
  bf16 and nf4 baselines;
- --steps GRPO steps, each: `batch` random prompts of --prompt-len tokens x --generations samples
  of exactly --completion tokens (no stop token can be sampled, so every row is full length and
  every format does the same work) through the rollout engine (`run_rollout`), its KV cache and
  graphs then freed or kept as --rollout-memory says (`qerl.rl.memory_plan`, as the trainer does),
  rewards from the sampled tokens (fraction of even ids: they differ within a group, so every row
  trains), group advantages, then the trainer's own `optimise`: micro-batches of --micro-batch
  completions, chunked log-probs, backward, AdamW.
The first step compiles kernels and captures graphs, so the last step is the one reported. With
--rollout-memory auto (the trainer's default) the first step frees the rollout memory and measures
training; the second re-captures the graphs and keeps them if they fit; the third (--steps 3) is
the steady state. --rollout-memory release reproduces the smallest peak (the 32B memory goal).

Rows (memory.json): {"model", "format", "gpu", "generations", "completion_len", "lora_rank",
"status": "ok" | "oom", "peak_gib", "rollout_s", "logprob_s", "backward_s", "optimizer_s",
"step_s"} plus "batch" (prompts per step), "completions", the peak of each phase and the build.
peak_gib is the peak of memory reserved by PyTorch's allocator over the step (what the card must
hold, fragmentation included; the CUDA context, ~0.5 GiB, comes on top); peak_allocated_gib is the
peak of live tensors. "alloc_retries" / "full_gc_collections": the CUDA allocator's retries (cache freed,
driver asked again) and Python's generation-2 collections during the reported step, the pauses that explain
an outlying phase time. "oom_retries" (when any): [{"step", "gave_way"}] for each training phase that ran
out of memory and trained again after a plan gave memory back ("checkpoint_layers" or "rollout_memory"),
kept also when the retry ran out too (status "oom"). grpo_step.json: {"model", "format", "batch", "step_s", "bf16_step_s",
"speedup"} with speedup = bf16 LoRA step time / this step time, same model, batch and micro-batch
(and both steady-state steps, or both single warm-up steps).
Rows are keyed by (model, format, batch, micro-batch, weight copies, GPU, bf16 autocast, allocator
settings, rollout memory, device memory cap) and carry the command and date of their call. --profile-dir puts the last step's training phase under torch.profiler and
writes its kernel table there (those rows are marked "profiled": their times carry the profiler's
overhead, keep them out of the evidence).
Both files are rewritten after every configuration, so a call cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import subprocess
import sys
import time
import traceback
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from qerl.env import switches_prefix  # noqa: E402
from qerl.kernels.layout import order_setting  # noqa: E402

FORMATS = ("bf16", "nf4", "mxfp4", "nvfp4")
MEMORY_FIELDS = ("model", "format", "gpu", "generations", "completion_len", "lora_rank", "status", "peak_gib",
                 "rollout_s", "logprob_s", "backward_s", "optimizer_s", "step_s")
STEP_FIELDS = ("model", "format", "batch", "step_s", "bf16_step_s", "speedup")
PHASES = ("rollout_s", "logprob_s", "backward_s", "optimizer_s")
ROLLOUT_MEMORY = {"auto": "auto", "release": True, "keep": False}  # --rollout-memory -> GRPOSettings
GIB = 2 ** 30
ROW_TAG = "BENCH_ROW "


def log(*a):
    print(*a, flush=True, file=sys.stderr)


# ----------------------------------------------------------------------------- one configuration


class _Memory:
    """Peak allocated / reserved bytes since the last mark (CUDA), or the process's max RSS (CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> tuple[float, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
        return rss, rss

    def stalls(self) -> tuple[int, int]:
        """(the CUDA allocator's retries so far: each time it freed its cached blocks and asked the driver
        again, a pause of up to ~1 s; Python's full (generation-2) garbage collections so far): counted
        around a step, they say whether an outlying phase time was one of these pauses."""
        retries = int(torch.cuda.memory_stats().get("num_alloc_retries", 0)) if self.cuda else 0
        return retries, int(gc.get_stats()[2]["collections"])


def run_one(args, preset: str, fmt: str, batch: int) -> dict:
    """Build, then --steps GRPO steps; the row of the last step (status "oom" where memory ran out)."""
    from qerl.build import build_model
    from qerl.nn.aqn import AdaptiveQuantNoise, AQNSettings
    from qerl.nn.lora import LoraSettings
    from qerl.rl.grpo import GRPOSettings, group_advantages
    from qerl.rl.rollout import RolloutSettings
    from qerl.rl.memory_plan import CheckpointPlan, RolloutMemoryPlan, cap_device_memory
    from qerl.rl.trainer import (PhaseTimer, make_optimizer, optimise_planned, plan_next_step_memory, prepare_policy,
                                 run_rollout, shares_prompt_in_training)
    from qerl.rollout.engine import engine_rollouts

    device = torch.device(args.device)
    gens = args.generations
    completions = batch * gens
    micro = min(args.micro_batch, completions)
    if completions % micro:
        raise SystemExit(f"{completions} completions do not split into micro-batches of {micro}")
    aqn_on = fmt == "nvfp4" and not args.no_aqn
    checkpointing = args.gradient_checkpointing == "on"
    from qerl.nn import quant_linear

    quant_linear.SINGLE_COPY = not args.keep_checkpoint_layout
    row = {
        "model": preset, "format": fmt, "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "generations": gens, "completion_len": args.completion, "lora_rank": args.rank, "status": "ok",
        "peak_gib": None, **{p: None for p in PHASES}, "step_s": None,
        "batch": batch, "completions": completions, "prompt_len": args.prompt_len, "micro_batch": micro,
        "aqn": aqn_on, "gradient_checkpointing": checkpointing, "logprob_chunk_tokens": args.chunk_tokens,
        "steps": args.steps, "weight_copies": _copies(fmt, args.keep_checkpoint_layout),
        "bf16_autocast": args.bf16_autocast,
        # GRPOSettings.fused_training_ops (qerl.nn.fused_train; rows before session 33 ran without)
        "fused_training_ops": not args.no_fused_training_ops,
        # the fused RoPE (on by default since session 34; QERL_FUSED_ROPE=0 turns it off)
        "fused_rope": _fused_rope() and not args.no_fused_training_ops,
        # the caching allocator's settings (e.g. expandable_segments:True), "" for the default
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        # GRPOSettings.release_rollout_memory as a name; rollout_memory_released: whether the reported
        # step freed the KV cache and graphs (auto frees until a measured step says keeping fits)
        "rollout_memory": args.rollout_memory,
        # GRPOSettings.checkpoint_layers; uncheckpointed_layers: how many layers the reported step ran
        # without checkpointing (auto plans them from the previous step's measured peak)
        "checkpoint_layers": args.checkpoint_layers,
        # GRPOSettings.device_memory_gib: the allocator capped there, the memory plans sized to it (None: the card)
        "device_memory_gib": args.device_memory_gib,
        # nf4 only: "baseline" (QLoRA's dequantise-then-cuBLAS) or "fused<=N" (QERL_NF4_FUSED_MAX_M, labelled)
        "nf4_decode": quant_linear.nf4_decode(fmt),
        # nvfp4 only: the word-order setting (QERL_W4A16_ORDER; "auto", the default since session 77, is frag on
        # sm_90 layers with K % 256 == 0); rows before the field ran "rows" unless their command sets it
        "w4a16_order": order_setting(fmt),
    }
    cap_device_memory(device, args.device_memory_gib)  # before the build, so the weights count under the cap
    mem = _Memory(device)
    phase = "build"
    try:
        mem.mark()
        t0 = time.perf_counter()
        model = build_model(f"random:{preset}", fmt, device, seed=0, progress=False)
        for p in model.parameters():
            p.requires_grad_(False)
        row["build_s"] = round(time.perf_counter() - t0, 2)
        row["build_peak_gib"] = round(mem.peak()[1], 3)
        row["weights_gib"] = round(sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) / GIB, 3)
        settings = GRPOSettings(
            num_generations=gens, per_device_train_batch_size=micro, gradient_accumulation_steps=completions // micro,
            max_completion_length=args.completion, max_steps=args.steps, learning_rate=1e-5, loss_type="dapo",
            epsilon_high=0.28, temperature=1.0, gradient_checkpointing=checkpointing,
            logprob_chunk_tokens=args.chunk_tokens,
            release_rollout_memory=ROLLOUT_MEMORY[args.rollout_memory], bf16_autocast=args.bf16_autocast,
            fused_training_ops=not args.no_fused_training_ops, checkpoint_layers=args.checkpoint_layers,
            device_memory_gib=args.device_memory_gib,
        )
        share_train = shares_prompt_in_training(settings)  # as train() does
        row["share_prompt"] = share_train
        phase = "lora"
        policy = prepare_policy(model, settings, LoraSettings(r=args.rank, lora_alpha=args.rank))
        optimizer, scheduler = make_optimizer(policy, settings)
        aqn = AdaptiveQuantNoise(policy, AQNSettings(enabled=aqn_on), total_steps=settings.max_steps)
        g = torch.Generator().manual_seed(1)
        vocab = int(model.config.vocab_size)
        prompts = [torch.randint(0, min(vocab, 150000), (args.prompt_len,), generator=g).tolist() for _ in range(batch)]
        # stop id outside the vocabulary: never sampled, so every row is --completion tokens long
        rs = RolloutSettings(num_generations=gens, max_new_tokens=args.completion, temperature=1.0,
                             stop_ids=[10**9], pad_id=0)
        gen = torch.Generator(device=device).manual_seed(0)
        plan = RolloutMemoryPlan(settings.release_rollout_memory, device)
        layers_plan = CheckpointPlan(settings.checkpoint_layers, device)
        for step in range(args.steps):
            timer = PhaseTimer(device)
            mem.mark()
            stalls0 = mem.stalls()
            t_step = time.perf_counter()
            aqn.resample(step)
            phase = "rollout"
            with timer("rollout_s"):
                rollout = run_rollout(policy, engine_rollouts, prompts, rs, gen, aqn, aqn_on)
            engine = policy.__dict__.get("_qerl_rollout_engine")
            row["kv_cache_gib"] = round(engine.cache_bytes / GIB, 3) if engine is not None else None
            plan.after_rollout(policy)
            rollout_peak = mem.peak()
            mem.mark()
            phase = "train"
            rewards = (rollout.completion_ids % 2 == 0).double().mul(rollout.completion_mask).sum(-1)
            rewards = rewards / rollout.completion_mask.sum(-1).clamp(min=1)
            adv = group_advantages(rewards, gens, settings.reward_scaling)
            with _maybe_profile(args, step, f"{preset}_{fmt}_b{batch}"), _retries_noted(row, step + 1):
                stats = optimise_planned(policy, [(rollout, rewards, adv)], settings, optimizer, scheduler, aqn, False,
                                         share_train, step + 1, timer, plan, layers_plan)
            row["profiled"] = bool(args.profile_dir)
            if device.type == "cuda":
                torch.cuda.synchronize()
            train_peak = mem.peak()
            uncheckpointed = layers_plan.applied
            plan_next_step_memory(policy, settings, [rollout], plan, layers_plan)  # as train() does
            step_s = time.perf_counter() - t_step
            tokens = int(rollout.completion_mask.sum())
            alloc_retries, full_gcs = (n - n0 for n, n0 in zip(mem.stalls(), stalls0))
            row.update(
                step_s=round(step_s, 3), **{p: round(timer.seconds.get(p, 0.0), 3) for p in PHASES},
                peak_gib=round(max(rollout_peak[1], train_peak[1]), 3),
                peak_allocated_gib=round(max(rollout_peak[0], train_peak[0]), 3),
                rollout_peak_gib=round(rollout_peak[1], 3), train_peak_gib=round(train_peak[1], 3),
                rollout_peak_allocated_gib=round(rollout_peak[0], 3), train_peak_allocated_gib=round(train_peak[0], 3),
                rollout_tokens=tokens, rollout_tokens_per_s=round(tokens / max(timer.seconds["rollout_s"], 1e-9), 1),
                loss=stats["loss"], grad_norm=stats["grad_norm"], rollout_memory_released=plan.released,
                uncheckpointed_layers=uncheckpointed,
                alloc_retries=alloc_retries, full_gc_collections=full_gcs,
            )
            if step == 0 and args.steps > 1:
                row["warmup_step_s"] = round(step_s, 3)
            log(f"  {preset} {fmt} batch {batch} step {step + 1}: {step_s:.2f} s, peak {row['peak_gib']:.2f} GiB "
                f"({', '.join(f'{p} {row[p]:.2f}' for p in PHASES)})")
    except torch.OutOfMemoryError:
        row.update(status="oom", oom_phase=phase)
        if device.type == "cuda":
            row["peak_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
        log(f"  {preset} {fmt} batch {batch}: out of memory in {phase}")
    return row


@contextlib.contextmanager
def _retries_noted(row: dict, step: int):
    """Notes in row["oom_retries"] each time the trainer's plans gave memory back after the training phase
    ran out and trained the step again (optimise_planned's RuntimeWarning), also when the retry itself
    then ran out: which plan gave way, and in which step. Other warnings are shown as usual."""
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            yield
    finally:
        for w in caught:
            text = str(w.message)
            if "trains again" in text:
                what = "checkpoint_layers" if "checkpointing" in text else "rollout_memory"
                row.setdefault("oom_retries", []).append({"step": step, "gave_way": what})
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _fused_rope() -> bool:
    from qerl.nn import fused_train

    return bool(fused_train.ENABLED_ROPE)


@contextlib.contextmanager
def _maybe_profile(args, step: int, name: str):
    """The last step's training phase under torch.profiler (CUDA kernels): its kernel table to
    --profile-dir/profile_<name>.txt, sorted by GPU time."""
    if not args.profile_dir or step != args.steps - 1:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if torch.device(args.device).type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        yield
    sort = "cuda_time_total" if ProfilerActivity.CUDA in activities else "cpu_time_total"
    os.makedirs(args.profile_dir, exist_ok=True)
    with open(os.path.join(args.profile_dir, f"profile_{name}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90))


# ----------------------------------------------------------------------------- the sweep


def _copies(fmt: str, keep_checkpoint_layout: bool) -> int:
    """Copies of the 4-bit weights in memory: the fused kernels' layout and, kept or not, the
    checkpoint tensors it was built from (QuantLinear.SINGLE_COPY)."""
    return 2 if fmt in ("nvfp4", "mxfp4") and keep_checkpoint_layout else 1


def _row_copies(row: dict) -> int:
    # rows measured before the kernel layout became the only copy (session 13) held two
    return row.get("weight_copies", _copies(row["format"], True))


# settings a row shares with its bf16 baseline beside model, batch and micro-batch, each with the
# value of the time before the field existed (rows of older calls)
SETUP_DEFAULTS = {"gpu": None, "bf16_autocast": False, "alloc_conf": "", "rollout_memory": "release",
                  "gradient_checkpointing": True, "fused_training_ops": False, "fused_rope": False,
                  "checkpoint_layers": "all", "device_memory_gib": None}


def _setup_fields(row: dict) -> dict:
    return {name: row.get(name, default) for name, default in SETUP_DEFAULTS.items()}


def _setup(row: dict) -> tuple:
    """What a row shares with its bf16 baseline: model, batch, micro-batch and SETUP_DEFAULTS' fields
    (GPU, autocast, allocator settings, rollout-memory setting, gradient checkpointing, fused training
    ops, fused RoPE)."""
    return (row["model"], row["batch"], row["micro_batch"], *_setup_fields(row).values())


def _key(row: dict) -> tuple:
    from qerl.nn.quant_linear import nf4_decode_of

    # a fused-decode nf4 row never replaces a baseline one (rows before the field: read from their command)
    return (*_setup(row), row["format"], _row_copies(row), nf4_decode_of(row))


def _pair(row: dict) -> tuple:
    """What a row and its bf16 baseline share; a one-step row includes the warm-up (compiles,
    captures), so it is compared only with its like."""
    return (*_setup(row), row.get("steps", 1) > 1)


def _bf16_baselines(rows: list[dict]) -> dict[tuple, dict]:
    """The measured bf16 rows by `_pair` (the last one wins)."""
    return {_pair(r): r for r in rows if r["format"] == "bf16" and r["status"] == "ok"}


def same_call_baselines(part: dict) -> None:
    """Give each non-bf16 row of one call's memory.json the bf16 step of that call with the same
    setup (`bf16_same_call`: step_s and date), so that a later call's bf16 row, which replaces this
    one in a combined file, does not become its baseline. A combined file (its command a list) is
    left alone: its rows come from several calls and keep what they carry."""
    if isinstance(part.get("command"), list):
        return
    bf16 = _bf16_baselines(part["rows"])
    for r in part["rows"]:
        base = bf16.get(_pair(r))
        if r["format"] != "bf16" and base is not None:
            r["bf16_same_call"] = {"step_s": base["step_s"], "date": base.get("date", part.get("date"))}


def step_rows(memory_rows: list[dict]) -> list[dict]:
    """grpo_step.json rows: every measured (ok) configuration, with the bf16 LoRA step of the same
    model and batch as its baseline (None where that one did not run or did not fit)."""
    from qerl.nn.quant_linear import nf4_decode_of

    bf16 = _bf16_baselines(memory_rows)
    out = []
    for r in memory_rows:
        if r["status"] != "ok":
            continue
        # the bf16 step of the row's own call where it had one (combine keeps it), else the latest bf16 row
        base_row = r.get("bf16_same_call") or bf16.get(_pair(r))
        base = base_row["step_s"] if base_row else None
        out.append({"model": r["model"], "format": r["format"], "batch": r["batch"], "step_s": r["step_s"],
                    "bf16_step_s": base, "speedup": round(base / r["step_s"], 3) if base else None,
                    "micro_batch": r["micro_batch"], "generations": r["generations"], "completion_len": r["completion_len"],
                    "weight_copies": _row_copies(r), "nf4_decode": nf4_decode_of(r), "steps": r.get("steps"),
                    **_setup_fields(r),
                    # when the baseline ran: the same call as this row, or another call on the same GPU model
                    "date": r.get("date"), "bf16_date": base_row.get("date") if base_row else None})
    return out


def _child(args, preset: str, fmt: str, batch: int, timeout: float) -> tuple[dict | None, str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{preset}:{fmt}:{batch}", *args.child_args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        sys.stderr.write(err)
        return None, f"timed out after {timeout:.0f} s"
    sys.stderr.write(proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith(ROW_TAG):
            return json.loads(line[len(ROW_TAG):]), ""
    last = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return None, f"exit {proc.returncode}: {last[-1] if last else 'no output'}"


def sweep(args) -> dict:
    os.makedirs(args.out_dir, exist_ok=True)
    mem_path = os.path.join(args.out_dir, args.memory_name)
    step_path = os.path.join(args.out_dir, args.step_name)
    device = torch.device(args.device)
    rows: list[dict] = []
    if args.append and os.path.exists(mem_path):
        with open(mem_path) as f:
            old = json.load(f)
        same_call_baselines(old)  # a bf16 row this call re-measures must not become their baseline
        rows = [dict({"command": old.get("command"), "date": old.get("date")}, **r) for r in old["rows"]]
    meta = {
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": switches_prefix() + "python benchmarks/bench_grpo_step.py " + " ".join(args.argv),
        "note": ("random-initialised Qwen2.5-*-shaped models (honest for speed and memory, not quality); batch = "
                 "prompts per step, each with `generations` samples of exactly completion_len tokens; the last of "
                 "`steps` steps is reported (the first compiles kernels and captures graphs)"),
    }
    not_run: list[dict] = []
    started = time.perf_counter()

    def save():
        with open(mem_path, "w") as f:
            json.dump(dict(meta, rows=rows, not_run=not_run), f, indent=1)
        with open(step_path, "w") as f:
            json.dump(dict(meta, rows=step_rows(rows)), f, indent=1)

    for preset in args.models:
        for batch in args.batches:
            for fmt in sorted(args.formats, key=lambda f: f != "bf16"):  # the baseline first
                left = args.time_budget_s - (time.perf_counter() - started)
                if left < args.min_config_s:
                    not_run.append({"model": preset, "format": fmt, "batch": batch, "why": "time budget"})
                    continue
                log(f"{preset} {fmt} batch {batch} ({left:.0f} s of the budget left)")
                row, why = _child(args, preset, fmt, batch, left)
                if row is not None:
                    row.update(command=meta["command"], date=meta["date"])
                if row is None:
                    not_run.append({"model": preset, "format": fmt, "batch": batch, "why": why})
                else:
                    rows[:] = [r for r in rows if _key(r) != _key(row)] + [row]
                save()
    save()
    result = dict(meta, rows=rows, not_run=not_run)
    print(table(result))
    return result


def combine(paths: list[str], out_dir: str) -> dict:
    """Merge the memory.json files of several calls (a later file's row of the same model, format,
    batch and micro-batch replaces an earlier one; rows keep the command and date of their call,
    and the bf16 step of their call where it ran one: same_call_baselines) into out_dir's
    memory.json and grpo_step.json. A combined file can be one of them."""
    parts = [json.load(open(p)) for p in paths]
    for part in parts:
        same_call_baselines(part)
    rows: dict[tuple, dict] = {}
    for part in parts:
        for r in part["rows"]:
            r = dict({"command": part.get("command"), "date": part.get("date")}, **r)
            rows[_key(r)] = r
    meta = {k: v for k, v in parts[-1].items() if k not in ("rows", "not_run", "command", "date")}

    def each(p, key):  # a combined file lists its calls' commands and dates: kept flat
        return p.get(key) if isinstance(p.get(key), list) else [p.get(key)]

    meta.update(command=[c for p in parts for c in each(p, "command")], date=[d for p in parts for d in each(p, "date")])
    result = dict(meta, rows=list(rows.values()))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "memory.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "grpo_step.json"), "w") as f:
        json.dump(dict(meta, rows=step_rows(result["rows"])), f, indent=1)
    print(table(result))
    return result


def table(result: dict) -> str:
    steps = {_key(r): r for r in step_rows(result["rows"])}
    lines = ["| model | format | batch | micro | weight copies | status | step s | rollout | logprob | backward | optimizer | peak GiB | x bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        s = steps.get(_key(r), {})
        cells = [r["model"], r["format"], r["batch"], r["micro_batch"], _row_copies(r), r["status"], r["step_s"], *[r[p] for p in PHASES],
                 r["peak_gib"], s.get("speedup")]
        lines.append("| " + " | ".join("" if c is None else (f"{c:.2f}" if isinstance(c, float) else str(c)) for c in cells) + " |")
    for n in result.get("not_run", []):
        lines.append(f"not run: {n['model']} {n['format']} batch {n['batch']}: {n['why']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--memory-name", default="memory.json")
    ap.add_argument("--step-name", default="grpo_step.json")
    ap.add_argument("--append", action="store_true", help="keep the rows of --out-dir's files that this call does not re-measure")
    ap.add_argument("--models", nargs="+", default=["qwen2.5-7b", "qwen2.5-14b"])
    ap.add_argument("--formats", nargs="+", default=["bf16", "nf4", "nvfp4"], choices=FORMATS)
    ap.add_argument("--batches", nargs="+", type=int, default=[2, 4, 8], help="prompts per step")
    ap.add_argument("--generations", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--completion", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8, help="completions per training micro-batch")
    ap.add_argument("--chunk-tokens", type=int, default=1024, help="tokens per lm_head + log-softmax chunk")
    ap.add_argument("--steps", type=int, default=3,
                    help="GRPO steps per configuration; the last is reported (with --rollout-memory auto the third is "
                         "the first that neither compiles nor re-captures graphs)")
    ap.add_argument("--no-aqn", action="store_true", help="AQN off for nvfp4 too")
    ap.add_argument("--bf16-autocast", action="store_true", help="GRPOSettings.bf16_autocast on: LoRA in bf16 in training (the trainer's default on "
                    "a GPU since session 32; without the flag this bench turns it off, as in its older rows)")
    ap.add_argument("--no-fused-training-ops", action="store_true",
                    help="GRPOSettings.fused_training_ops off: Hugging Face's RMSNorm / MLP, PEFT's LoRA update and the float32 "
                         "log-softmax in training, as before session 33")
    ap.add_argument("--profile-dir", default=None, help="profile the last step's training phase, kernel tables here")
    ap.add_argument("--keep-checkpoint-layout", action="store_true",
                    help="keep the 4-bit checkpoint tensors beside the kernels' layout (two copies; the old default)")
    ap.add_argument("--rollout-memory", choices=list(ROLLOUT_MEMORY), default="auto",
                    help="GRPOSettings.release_rollout_memory: free the KV cache and graphs after each rollout (release), "
                         "never (keep), or once measured training leaves room, keep them (auto, the trainer's default)")
    ap.add_argument("--gradient-checkpointing", choices=["on", "off"], default="on",
                    help="GRPOSettings.gradient_checkpointing; off also shares each group's prompt in training, as train() does")
    ap.add_argument("--checkpoint-layers", choices=["all", "auto"], default="auto",
                    help="GRPOSettings.checkpoint_layers: every decoder layer recomputes in the backward (all: the smallest "
                         "peak, what the 32B memory goal is measured with), or the layers that fit in the memory a measured "
                         "step leaves free keep their activations (auto, the trainer's default)")
    ap.add_argument("--device-memory-gib", type=float, default=None,
                    help="GRPOSettings.device_memory_gib: run as on a card of this many GiB (the allocator raises "
                         "out-of-memory beyond it, the memory plans size to it); 79 stands for the paper's 80 GB H100 "
                         "on a larger card")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--time-budget-s", type=float, default=540)
    ap.add_argument("--min-config-s", type=float, default=20, help="start no configuration with less of the budget left")
    ap.add_argument("--combine", nargs="+", default=None, metavar="MEMORY_JSON",
                    help="merge the memory.json files of several calls into --out-dir (later rows replace earlier ones)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # MODEL:FORMAT:BATCH, in a child process
    args = ap.parse_args(argv)
    args.argv = list(argv)
    if args.combine:
        combine(args.combine, args.out_dir)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_grpo_step.py needs a CUDA GPU (or --device cpu for a tiny trial)")
    if args.one:
        preset, fmt, batch = args.one.split(":")
        try:
            row = run_one(args, preset, fmt, int(batch))
        except Exception:
            traceback.print_exc()
            raise SystemExit(1)
        print(ROW_TAG + json.dumps(row), flush=True)
        return
    # what every child process gets: the options of one configuration
    child = ["--device", args.device, "--generations", str(args.generations), "--prompt-len", str(args.prompt_len),
             "--completion", str(args.completion), "--rank", str(args.rank), "--micro-batch", str(args.micro_batch),
             "--chunk-tokens", str(args.chunk_tokens), "--steps", str(args.steps)]
    child += ["--no-aqn"] * args.no_aqn + ["--rollout-memory", args.rollout_memory]
    child += ["--gradient-checkpointing", args.gradient_checkpointing, "--checkpoint-layers", args.checkpoint_layers]
    child += ["--keep-checkpoint-layout"] * args.keep_checkpoint_layout + ["--bf16-autocast"] * args.bf16_autocast
    child += ["--no-fused-training-ops"] * args.no_fused_training_ops
    child += ["--device-memory-gib", str(args.device_memory_gib)] if args.device_memory_gib else []
    child += ["--profile-dir", os.path.abspath(args.profile_dir)] if args.profile_dir else []
    args.child_args = child
    sweep(args)


if __name__ == "__main__":
    main()
