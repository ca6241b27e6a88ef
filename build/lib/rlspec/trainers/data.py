"""Training data: the embedded arithmetic set and hub datasets mapped to one shape.

Every dataset this module returns has two columns, the shape TRL's GRPOTrainer and our rewards read:
- `prompt`: a conversation, `[{"role": "user", "content": ...}]` with an optional system turn first
  (TRL applies the chat template);
- `answer`: the verifiable final answer as a string (what `rlspec.trainers.rewards.accuracy_reward` checks).

The embedded set needs no network: small arithmetic word problems, seeded, easy enough that
SmolLM2-135M-Instruct earns a nonzero reward. Measured through our engine (bf16, T=1.0, 64 new
tokens, the same 16 mixed addition problems x 4 samples, accuracy_reward): mean 0.22 with the
instruction in the user turn and the chat template's own system prompt (our default), 0.14 with the
instruction as a system prompt; 64 samples, so about +-0.05 either way.
"""
from __future__ import annotations

import os
import random
from typing import Any

# Appended to every question. In the user turn, not a system prompt: SmolLM2 scores better so (above).
DEFAULT_INSTRUCTION = "Put the final answer in \\boxed{}."

# Question templates per operator ({a} and {b} are the operands): one plain form and short word
# problems, all answerable in one line so a 135M model still earns reward.
_TEMPLATES: dict[str, list[str]] = {
    "+": [
        "What is {a} + {b}?",
        "Tom has {a} apples and buys {b} more. How many apples does Tom have now?",
        "A box holds {a} red balls and {b} blue balls. How many balls are in the box?",
    ],
    "-": [
        "What is {a} - {b}?",
        "Anna has {a} stickers and gives away {b}. How many stickers does Anna have left?",
    ],
    "*": [
        "What is {a} * {b}?",
        "There are {a} bags with {b} marbles in each bag. How many marbles are there in total?",
    ],
}
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

# Hub datasets we know how to map: name -> (default config, question column, answer column).
_KNOWN_HUB = {
    "openai/gsm8k": ("main", "question", "answer"),
    "gsm8k": ("main", "question", "answer"),
}


def make_math_dataset(
    num_examples: int = 256,
    seed: int = 0,
    max_operand: int = 9,
    ops: tuple[str, ...] | list[str] = ("+",),
    system_prompt: str | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
):
    """Seeded arithmetic problems with exact answers, as a `datasets.Dataset` (columns prompt, answer).

    Operands are drawn uniformly from [0, max_operand]; subtraction keeps a >= b so answers stay
    non-negative. The same (num_examples, seed, max_operand, ops) always gives the same rows.
    system_prompt None leaves the system turn to the chat template (SmolLM2 adds its own);
    instruction is appended to each question.
    """
    import datasets

    unknown = [op for op in ops if op not in _TEMPLATES]
    if unknown or not ops:
        raise ValueError(f"ops must be a non-empty subset of {sorted(_TEMPLATES)}, got {list(ops)!r}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    rng = random.Random(seed)
    rows: dict[str, list[Any]] = {"prompt": [], "answer": []}
    for _ in range(num_examples):
        op = rng.choice(list(ops))
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and b > a:
            a, b = b, a
        question = rng.choice(_TEMPLATES[op]).format(a=a, b=b)
        rows["prompt"].append(_conversation(question, instruction, system_prompt))
        rows["answer"].append(str(_APPLY[op](a, b)))
    return datasets.Dataset.from_dict(rows)


def load_dataset_by_name(
    name: str,
    split: str = "train",
    num_examples: int | None = None,
    seed: int = 0,
    **kwargs: Any,
):
    """Load a dataset by name and map it to the prompt/answer shape.

    name: "embedded_math" (built in; kwargs go to make_math_dataset), a hub id such as
    "openai/gsm8k" (config "main" by default; the answer is the text after "####"), or a local
    path `datasets.load_dataset` understands. kwargs for hub datasets: `config` (the subset name),
    `system_prompt`, `instruction`, `question_column`, `answer_column`; others go to load_dataset. num_examples=None keeps every row
    (after a seeded shuffle).
    """
    if name == "embedded_math":
        return make_math_dataset(num_examples=num_examples or 256, seed=seed, **kwargs)
    system_prompt = kwargs.pop("system_prompt", None)
    instruction = kwargs.pop("instruction", DEFAULT_INSTRUCTION)
    default_config, q_col, a_col = _KNOWN_HUB.get(name, (None, "question", "answer"))
    config = kwargs.pop("config", default_config)
    q_col = kwargs.pop("question_column", q_col)
    a_col = kwargs.pop("answer_column", a_col)
    ds = _load_or_explain(name, config, split, **kwargs)
    ds = ds.shuffle(seed=seed)
    if num_examples is not None:
        ds = ds.select(range(min(num_examples, len(ds))))
    if "prompt" in ds.column_names and "answer" in ds.column_names:
        return ds  # already in our shape
    missing = [c for c in (q_col, a_col) if c not in ds.column_names]
    if missing:
        raise ValueError(
            f"dataset {name!r} has columns {ds.column_names}, not {missing}: pass "
            "question_column=... and answer_column=... to say which columns hold the question and the answer"
        )

    def to_row(example: dict) -> dict:
        return {
            "prompt": _conversation(example[q_col], instruction, system_prompt),
            "answer": extract_final_answer(str(example[a_col])),
        }

    return ds.map(to_row, remove_columns=ds.column_names)


def extract_final_answer(text: str) -> str:
    """GSM8K-style answers end with "#### 72": keep what follows the marker, without thousands commas."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return text.strip().replace(",", "")


def _conversation(question: str, instruction: str, system_prompt: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    user = f"{question} {instruction}" if instruction else question
    return messages + [{"role": "user", "content": user}]


def _load_or_explain(name: str, config: str | None, split: str, **kwargs: Any):
    """datasets.load_dataset, with a failure message that says where it looked and what to do."""
    import datasets

    try:
        return datasets.load_dataset(name, config, split=split, **kwargs)
    except Exception as exc:  # datasets raises many types (ConnectionError, FileNotFoundError, ValueError...)
        offline = datasets.config.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        looked = [
            f"a local path {os.path.abspath(name)!r} ({'exists' if os.path.exists(name) else 'not found'})",
            f"the datasets cache {datasets.config.HF_DATASETS_CACHE!r}",
            "the Hugging Face Hub" + (" (skipped: offline mode is on, HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)" if offline else ""),
        ]
        raise FileNotFoundError(
            f"could not load dataset {name!r} (config {config!r}, split {split!r}): {type(exc).__name__}: {exc}. "
            f"Looked in: {'; '.join(looked)}. Fix: check the name, download it once where the hub is reachable "
            "(it is then cached), or use name='embedded_math' for the built-in offline arithmetic set."
        ) from exc


def prompt_token_ids(tokenizer, prompts: list) -> list[list[int]]:
    """Token ids of prompts as TRL feeds them to generation: conversations through the chat template
    (with the generation prompt), plain strings tokenized as they are."""
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template(p, add_generation_prompt=True) if isinstance(p, list) else tokenizer(p)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out
