"""Whether an RL step frees the rollout engine's KV cache and CUDA graphs before training.

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

import torch

# the fraction of device memory left free under "auto" (fragmentation, the CUDA context, spikes)
HEADROOM = 0.10


def fits_with_rollout_memory(base: int, train_peak: int, held: int, total: int, length_ratio: float = 1.0,
                             headroom: float = HEADROOM) -> bool:
    """True when a training phase that peaked at `train_peak` bytes from `base` would, with `held`
    more bytes kept and its activations grown by `length_ratio` (>= 1), stay under (1 - headroom)
    of `total`."""
    grown = base + max(0, train_peak - base) * max(1.0, float(length_ratio))
    return grown + max(0, held) <= (1.0 - headroom) * total


class _CudaMemory:
    """The caching allocator's numbers, as the plan reads them (tests give the plan their own)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.total = torch.cuda.get_device_properties(device).total_memory

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

    def after_training(self, trained_len: int, max_len: int) -> None:
        """Decide the next step from this step's training peak; trained_len / max_len: the longest
        sequence trained this step and the longest the settings allow."""
        if self.memory is None:
            return
        peak = self.memory.peak()
        if self.released:
            self.memory.empty_cache()  # the next rollout (its KV cache, graph captures) starts from a clean pool
        if self.setting == "auto" and self._base is not None and not self._gave_up:
            self.keeping = fits_with_rollout_memory(self._base, peak, self._held, self.memory.total,
                                                    max_len / max(1, trained_len), self.headroom)

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
