"""The memory plan of an RL step: whether it frees the rollout engine's KV cache and CUDA graphs
before training (RolloutMemoryPlan), and which decoder layers skip activation checkpointing
(CheckpointPlan, below).

Freeing them gives the training phase their memory (4.8 GB of KV cache for a 32B model at
8 x 2304 tokens), but the next rollout must capture every decode graph again: on an H100 that
cost a 7B batch-2 step about 1.05 s of its 9.1 s nvfp4 rollout and 0.67 s of bf16's 14.9 s
(benchmarks/NOTES_grpo.md, section 7). `GRPOSettings.release_rollout_memory` picks:

- True: free after every rollout (the smallest peak);
- False: never free (the engine keeps its cache and graphs from step to step);
- "auto" (the default): free after the first rollout and measure that step's training peak, then
  keep the cache and graphs from the next step on when the step would still fit with them held:

      base + (train_peak - base) * longest / trained + held <= (1 - HEADROOM) * device memory

  where `base` is the memory reserved once they were freed, `train_peak` the reserved peak of
  the training phase, `held` what freeing gave back, and longest / trained the ratio of the
  longest sequence the settings allow to the longest one this step trained (training activations
  grow with it). While keeping, each step checks the same bound with its own numbers (`held` is
  then inside the measured peak) and goes back to freeing when it fails. If a kept step's
  training still runs out of memory before its optimiser step, the trainer frees them, trains
  that step again and frees after every rollout from then on (`free_after_oom`). On a CPU there
  are no graphs to keep, so "auto" frees the cache after every rollout, as True does.

The bound counts the rollout's own cached blocks in `held` and scales the whole training
increment by the length ratio, so it errs towards freeing.
"""

from __future__ import annotations

import contextlib

import torch

# the fraction of device memory left free under "auto" (fragmentation, the CUDA context, spikes)
HEADROOM = 0.10


def grown_peak(base: int, train_peak: int, length_ratio: float = 1.0) -> float:
    """A training phase's peak from `base` with its increment grown by `length_ratio` (never shrunk)."""
    return base + max(0, train_peak - base) * max(1.0, float(length_ratio))


def fits_with_rollout_memory(base: int, train_peak: int, held: int, total: int, length_ratio: float = 1.0,
                             headroom: float = HEADROOM) -> bool:
    """True when a training phase that peaked at `train_peak` bytes from `base` would, with `held`
    more bytes kept and its activations grown by `length_ratio` (>= 1), stay under (1 - headroom)
    of `total`."""
    return grown_peak(base, train_peak, length_ratio) + max(0, held) <= (1.0 - headroom) * total


def cap_device_memory(device: torch.device | str, gib: float | None) -> int | None:
    """Make a CUDA device behave as one of `gib` GiB for this process: PyTorch's caching allocator raises
    out-of-memory beyond it (torch.cuda.set_per_process_memory_fraction), and the memory plans below size
    themselves against it (they read the allocator's fraction). E.g. 79 reproduces an 80 GB H100's budget on a
    141 GB H200 (the H100 shows 79.6 GiB; the CUDA context's ~0.5 GiB lies outside the allocator). Returns the
    cap in bytes; None where nothing is capped (gib None, not a CUDA device). A cap at or above the card's
    memory leaves the whole card. gib None lifts a cap this function set earlier in the process (a worker that
    runs a capped recipe and then an uncapped one), and leaves a fraction set by anyone else alone.
    GRPOSettings.device_memory_gib."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = _cuda_index(device)
    if gib is None:
        if _CAPPED.pop(index, None) is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, index)
        return None
    if gib <= 0:
        raise ValueError(f"device_memory_gib must be > 0, not {gib}")
    total = torch.cuda.get_device_properties(index).total_memory
    cap = min(int(gib * 2**30), total)
    torch.cuda.set_per_process_memory_fraction(cap / total, index)
    _CAPPED[index] = cap
    return cap


_CAPPED: dict[int, int] = {}  # device index -> the cap cap_device_memory set there


def _cuda_index(device: torch.device) -> int:
    """The index of a CUDA device; a bare "cuda" is the current device (torch's fraction getter refuses it)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def allowed_bytes(total: int, fraction: float | None) -> int:
    """What the allocator may hold of a device of `total` bytes under a per-process `fraction` (None: all)."""
    return total if fraction is None else int(total * min(1.0, max(0.0, float(fraction))))


class _CudaMemory:
    """The caching allocator's numbers, as the plan reads them (tests give the plan their own). `total` is
    what this process may use: the card's memory times the allocator's per-process fraction
    (cap_device_memory)."""

    def __init__(self, device: torch.device):
        self.device = device
        index = _cuda_index(device)
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        self.total = allowed_bytes(torch.cuda.get_device_properties(index).total_memory,
                                   get_fraction(index) if get_fraction else None)

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


class RolloutMemoryPlan:
    """Frees (or keeps) the rollout engine's memory between the phases of each RL step.

        plan = RolloutMemoryPlan(settings.release_rollout_memory, device)
        ... rollout ...
        plan.after_rollout(model)                  # frees when the plan says so
        ... training ...
        plan.after_training(trained_len, max_len)  # measures, decides the next step

    The training peak is the allocator's reserved peak since its statistics were last reset (the
    trainer resets them at each step's start, so a freeing step's peak may be its rollout's: the
    bound then errs towards freeing). `released`: whether this step freed; `keeping`: whether the
    next step will keep. `memory` stands in for the CUDA allocator (tests; without it, and off a
    GPU, "auto" frees after every rollout: there are no graph captures to save)."""

    def __init__(self, setting: bool | str, device: torch.device, headroom: float = HEADROOM, memory=None):
        if not (isinstance(setting, bool) or setting == "auto"):
            raise ValueError(f"release_rollout_memory must be true, false or 'auto', not {setting!r}")
        self.setting = setting
        if memory is None and torch.device(device).type == "cuda":
            memory = _CudaMemory(torch.device(device))
        self.memory = memory
        self.headroom = headroom
        # auto keeps once a measured step says it fits (never off a GPU: no captures to save there)
        self.keeping = setting is False
        self.released = False
        self._base = self._held = None
        self._gave_up = False  # auto, after a training phase ran out of memory with the rollout memory kept
        self.projected: int | None = None  # the next step's peak, every layer checkpointed (after_training)

    def after_rollout(self, model) -> None:
        """Free the engine's KV cache and graphs unless the plan keeps them. Notes the memory
        reserved then, which the training phase starts from, and what freeing gave back."""
        from qerl.rollout.engine import release_rollout_memory

        self.released = not self.keeping
        before = self.memory.reserved() if self.memory else 0
        if self.released:
            release_rollout_memory(model)
        if self.memory:
            self._base = self.memory.reserved()
            self._held = before - self._base if self.released else 0

    def after_training(self, trained_len: int, max_len: int, unplanned: int = 0) -> None:
        """Decide the next step from this step's training peak; trained_len / max_len: the longest
        sequence trained this step and the longest the settings allow; `unplanned`: bytes of the
        peak that the next step's own plan decides again (the activations of layers that ran without
        checkpointing, CheckpointPlan), taken out before the bound. Sets `projected`, the next step's
        peak with every layer checkpointed (None without a measurement)."""
        if self.memory is None:
            return
        peak = self.memory.peak()
        if self.released:
            self.memory.empty_cache()  # the next rollout (its KV cache, graph captures) starts from a clean pool
        if self._base is None:
            return
        peak = max(self._base, peak - max(0, unplanned))
        ratio = max_len / max(1, trained_len)
        if self.setting == "auto" and not self._gave_up:
            self.keeping = fits_with_rollout_memory(self._base, peak, self._held, self.memory.total, ratio,
                                                    self.headroom)
        # the next step's peak, grown as the bound grows it, plus what keeping holds (inside base
        # already when this step kept)
        held = self._held if self.keeping and self.released else 0
        self.projected = int(grown_peak(self._base, peak, ratio) + held)

    def free_after_oom(self, model) -> bool:
        """After the training phase ran out of memory: under "auto", if this step kept the
        engine's KV cache and graphs, free them now and free them after every rollout from here
        on; True then (the caller may train this step again), False when the plan kept nothing."""
        from qerl.rollout.engine import release_rollout_memory

        if self.setting != "auto" or self.released:
            return False
        # release_rollout_memory empties the allocator's cache as well; the trainer empties it again
        # once the failed attempt's tensors are gone
        release_rollout_memory(model)
        self.released, self.keeping, self._gave_up = True, False, True
        return True


# ---- which decoder layers recompute their activations in the backward -----------------------------
#
# With gradient checkpointing every decoder layer keeps only its input and recomputes its forward in
# the backward. With LoRA the base weights are frozen, so a layer's backward is about one forward's
# work (input gradients only), and the recomputation is close to half of the backward
# (benchmarks/NOTES_grpo.md section 19). GRPOSettings.checkpoint_layers "auto" spends the memory a
# step leaves free on keeping some layers' activations instead:
#
#     free_layers = floor(((1 - HEADROOM) * device memory - projected peak) / layer bytes)
#
# where the projected peak is the next step's with every layer checkpointed (the rollout plan's own
# bound: base + training increment grown to the longest sequence + the kept KV cache and graphs), and
# layer bytes what one layer keeps for its backward over the largest micro-batch at the longest
# sequence the settings allow (measured once by `layer_bytes_per_token`). "all" checkpoints every
# layer (the smallest peak). A training phase that still runs out of memory with free layers goes
# back to "all" for the rest of the run and trains that step again (CheckpointPlan.recompute_all_after_oom).


def decoder_layers(model) -> list:
    """The model's checkpointable decoder layers (Hugging Face's GradientCheckpointingLayer), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def layer_bytes_per_token(model, context=None, tokens: tuple[int, int] = (128, 256)) -> float:
    """Bytes a decoder layer's forward keeps for its backward, per token, when it is not checkpointed:
    the decoder runs (autograd on, every layer uncheckpointed, inside `context()`, e.g. the trainer's
    autocast and fused-op switches) over one row of `tokens[0]` and one of `tokens[1]` random ids;
    the storages saved for backward inside each layer are summed (each once) and averaged over the
    layers, and the slope between the two lengths is returned, so what does not grow with the tokens
    (weights, casts of the adapters) drops out. 0.0 for a model without decoder layers."""
    from qerl.rl.rollout import _decoder_and_head

    layers = decoder_layers(model)
    split = _decoder_and_head(model)
    if not layers or split is None:
        return 0.0
    decoder = split[0]
    device = next(model.parameters()).device
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or decoder.get_input_embeddings().num_embeddings)
    saved: dict[tuple[int, int], int] = {}
    where = [None]

    def pack(t):
        if where[0] is not None:
            storage = t.untyped_storage()
            saved[(where[0], storage.data_ptr())] = storage.nbytes()
        return t

    def enter(i):
        return lambda *_: where.__setitem__(0, i)

    hooks = [h for i, layer in enumerate(layers)
             for h in (layer.register_forward_pre_hook(enter(i)), layer.register_forward_hook(enter(None)))]
    flags = [layer.gradient_checkpointing for layer in layers]
    per_length = []
    try:
        for layer in layers:
            layer.gradient_checkpointing = False
        gen = torch.Generator().manual_seed(0)
        for n in tokens:
            saved.clear()
            ids = torch.randint(0, max(1, vocab), (1, n), generator=gen).to(device)
            with torch.enable_grad(), (context() if context else contextlib.nullcontext()), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = decoder(input_ids=ids, use_cache=False)
            del out
            per_length.append(sum(saved.values()) / len(layers))
    finally:
        for h in hooks:
            h.remove()
        for layer, flag in zip(layers, flags):
            layer.gradient_checkpointing = flag
        saved.clear()
    return max(0.0, (per_length[1] - per_length[0]) / (tokens[1] - tokens[0]))


# The probe may read up to 1.3x what the allocator holds for a layer (its GPU test's bound, which
# the H100 met; it also counts the layer's input, which a checkpointed layer keeps as well). So when
# the peak of a step that ran free layers is turned into the next step's all-checkpointed projection,
# only 1 / 1.3 of their probed bytes are taken out. Session 35 (H100, 14B batch 8 bf16, "auto"): a
# projection from a step with free layers, the full probed bytes taken out, let the next step keep the
# rollout's 27 GiB KV cache, and its training peaked at 73.8 GiB reserved (93% of the device, above
# the 90% bound; no OOM, but that step ran 1.9 s slower than the one before).
PROBE_CREDIT = 1.0 / 1.3


class CheckpointPlan:
    """How many decoder layers train without activation checkpointing (the last `free_layers` of
    them; the rest recompute). Used only with gradient_checkpointing on and, for "auto", a CUDA
    device (off a GPU it keeps every layer checkpointed).

        plan = CheckpointPlan(settings.checkpoint_layers, device)
        plan.apply(model)                      # before each training phase
        ... training ...
        plan.after_training(model, rollout_plan, rows, trained_len, max_len, probe)

    `rollout_plan` is the step's RolloutMemoryPlan after its own after_training (its projected
    peak); `rows` the rows of the largest micro-batch; `probe()` gives layer_bytes_per_token
    (called once)."""

    def __init__(self, setting: str, device: torch.device, headroom: float = HEADROOM, memory=None):
        if setting not in ("all", "auto"):
            raise ValueError(f"checkpoint_layers must be 'all' or 'auto', not {setting!r}")
        self.setting = setting
        if memory is None and setting == "auto" and torch.device(device).type == "cuda":
            memory = _CudaMemory(torch.device(device))
        self.memory = memory
        self.headroom = headroom
        self.free_layers = 0  # layers without checkpointing in the next training phase
        self.applied = 0  # ... and in the last one applied
        self.per_token: float | None = None
        self._gave_up = False

    def applied_bytes(self, rows: int, trained_len: int) -> int:
        """What the last applied free layers kept at once over a micro-batch of `rows` x `trained_len`,
        counted low (PROBE_CREDIT): the rollout plan takes it out of the measured peak, and a
        projection that errs high keeps less, never more."""
        return int(PROBE_CREDIT * self.applied * (self.per_token or 0.0) * rows * trained_len)

    def apply(self, model) -> None:
        """Checkpoint all but the last free_layers decoder layers (call it only on a model whose
        checkpointing is enabled: it sets the layers' flags, not the checkpoint function)."""
        layers = decoder_layers(model)
        k = min(self.free_layers, len(layers))
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i < len(layers) - k
        self.applied = k

    def after_training(self, model, rollout_plan: RolloutMemoryPlan, rows: int, max_len: int, probe) -> None:
        """Plan the next step: as many free layers as fit between the rollout plan's projected peak
        and (1 - headroom) of the device (0 under "all", off a GPU, without a projection, or after an
        out-of-memory fallback)."""
        projected = getattr(rollout_plan, "projected", None)
        if self.setting != "auto" or self.memory is None or self._gave_up or projected is None:
            self.free_layers = 0
            return
        if self.per_token is None:
            self.per_token = float(probe())
        layer = self.per_token * rows * max_len
        spare = (1.0 - self.headroom) * self.memory.total - projected
        self.free_layers = int(min(len(decoder_layers(model)), max(0, spare // layer))) if layer > 0 else 0

    def recompute_all_after_oom(self, model) -> bool:
        """After the training phase ran out of memory: if layers ran without checkpointing, checkpoint
        every layer from now on and return True (the caller may train the step again)."""
        if self.applied == 0:
            return False
        self.free_layers, self._gave_up = 0, True
        self.apply(model)
        return True
