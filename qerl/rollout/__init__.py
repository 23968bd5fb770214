"""Generation engines for RL rollouts and evaluation (see engine.py).

Importing this package imports torch only; the engine imports its pieces lazily through
`qerl.rollout.engine`.
"""

from qerl.rollout.sampling import sample_next, truncate

__all__ = ["sample_next", "truncate"]
