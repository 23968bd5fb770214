"""A generated arithmetic word-problem task, small enough for a 135M model to learn by RL on a CPU.

GSM8K is out of reach for SmolLM2-135M, so the embedded RL demo trains on one-step word
problems the project makes itself ("Tom has 3 apples and buys 4 more. How many apples does he
have?"), with small numbers. Problems are a pure function of (seed, index): the same seed gives
the same list on every machine. Gold answers are integers graded like GSM8K
(`qerl.rl.rewards.gsm8k_accuracy`); the prompt (`build_arith_prompt`, used by the trainer for
benchmark "arith") asks for a short answer after "####".

    train = make_problems(512, seed=0)
    test = make_problems(64, seed=1)     # a different seed: held-out problems

Try it:  python -m qerl.rl.arith
"""

from __future__ import annotations

import random
from typing import Sequence

from qerl.data import Problem

BENCHMARK = "arith"
OPERATIONS = ("add", "sub", "mul")
# Asks for a short answer: "think step by step" (the GSM8K instruction) makes a 135M model
# ramble past a 24-32 token budget. Two worked examples (chat turns) show the answer format:
# with them SmolLM2-135M at T=1 finishes ~75% of its answers within 24 tokens and gets ~30%
# right (without: ~20% finished, ~15% right), so RL can work on the arithmetic itself.
INSTRUCTION = 'Answer in the form "#### <number>".'
FEW_SHOT = (
    ("Anna has 2 pens and buys 3 more. How many pens does Anna have now?", "2 + 3 = 5\n#### 5"),
    ("Leo had 7 cards and lost 4 of them. How many cards are left?", "7 - 4 = 3\n#### 3"),
)

_NAMES = ("Tom", "Anna", "Ben", "Lily", "Sam", "Mia", "Max", "Emma", "Leo", "Zoe", "Jack", "Nora")
_ITEMS = ("apples", "books", "pens", "cookies", "stickers", "marbles", "cards", "flowers", "toys", "coins")

# (operation, template); {a}, {b}: numbers, {name}, {item}.
_TEMPLATES = {
    "add": (
        "{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
        "{name} had {a} {item}. A friend gave {name} {b} more {item}. How many {item} does {name} have?",
        "There are {a} {item} on a table and {b} {item} on a shelf. How many {item} are there in total?",
    ),
    "sub": (
        "{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?",
        "{name} had {a} {item} and lost {b} of them. How many {item} are left?",
    ),
    "mul": (
        "{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have?",
    ),
}


def _one(rng: random.Random, ops: Sequence[str], max_value: int) -> tuple[str, int]:
    op = rng.choice(list(ops))
    template = rng.choice(_TEMPLATES[op])
    if op == "mul":
        a, b = rng.randint(2, min(9, max_value)), rng.randint(2, min(9, max_value))
        ans = a * b
    elif op == "sub":
        a = rng.randint(2, max_value)
        b = rng.randint(1, a - 1)
        ans = a - b
    else:
        a, b = rng.randint(1, max_value), rng.randint(1, max_value)
        ans = a + b
    q = template.format(name=rng.choice(_NAMES), item=rng.choice(_ITEMS), a=a, b=b)
    return q, ans


def make_problems(
    n: int, seed: int = 0, operations: Sequence[str] = ("add", "sub"), max_value: int = 10
) -> list[Problem]:
    """`n` problems, deterministic for (seed, operations, max_value)."""
    bad = [o for o in operations if o not in OPERATIONS]
    if bad or not operations:
        raise ValueError(f"operations must be a non-empty subset of {OPERATIONS}, got {list(operations)}")
    if max_value < 2:
        raise ValueError(f"max_value must be >= 2, got {max_value}")
    rng = random.Random(f"qerl-arith-{seed}-{','.join(operations)}-{max_value}")
    out = []
    for i in range(n):
        q, ans = _one(rng, operations, max_value)
        out.append(Problem(id=f"arith-{seed}-{i}", question=q, answer=str(ans), benchmark=BENCHMARK))
    return out


def build_arith_prompt(tokenizer, question: str, num_shots: int = len(FEW_SHOT)) -> str:
    """The chat-formatted prompt for an arithmetic problem: `num_shots` worked examples as
    earlier chat turns, then the question (generation prompt added)."""
    messages = []
    for q, a in FEW_SHOT[:num_shots]:
        messages += [{"role": "user", "content": f"{q}\n{INSTRUCTION}"}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": f"{question.strip()}\n{INSTRUCTION}"})
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages) + "\n"


__all__ = ["BENCHMARK", "FEW_SHOT", "INSTRUCTION", "OPERATIONS", "build_arith_prompt", "make_problems"]


if __name__ == "__main__":
    for p in make_problems(5):
        print(p.answer.rjust(3), p.question)
