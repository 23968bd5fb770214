"""One process-wide lock for building modules, because transformers' `no_init_weights` is not
thread-local: while it is active it replaces `torch.nn.init.*` (and `PreTrainedModel.init_weights`)
in every thread. A LoRA adapter or a random model built in another thread at that moment keeps
its uninitialised `torch.empty` memory - garbage, sometimes NaN (the flow's intermittent
"probability tensor contains inf/nan" in a first 4-bit rollout, reproduced with three trainers
in threads). Everything in qerl that creates weights meant to be initialised, or opens such a
window (from_config under no_init_weights, from_pretrained, PEFT's adapter injection, a seeded
random model), runs under INIT_LOCK; the seeded global-RNG use of build_random is then also
serialised, so its weights no longer depend on what other threads draw.
"""

from __future__ import annotations

import threading

INIT_LOCK = threading.RLock()
