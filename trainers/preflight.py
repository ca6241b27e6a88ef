"""Preflight: what can be checked before step 1 is checked before step 1.

A prompt too long for the rollout engine's context used to surface when the sampler first drew its row,
possibly hours into a run. `check_dataset_prompts` tokenizes every prompt of the train dataset the way TRL
will (conversations through the chat template with the generation prompt, plain text as it is; TRL 1.16's
GRPOConfig has no prompt truncation, so the whole prompt reaches the engine) and applies the engine's own
length rule (rollout/limits.py). It raises PromptTooLongError naming the offending rows, or, when asked,
drops them and says how many. Cost: one tokenization of the dataset, at construction.

The same pass refuses rows that would fail only when the sampler draws them (hours in, and again after every
resume) or silently train on garbage: a missing or empty prompt (empty after templating too), a token id the
model has no embedding for (a tokenizer with tokens added after the model was built), and None in a column a
reward function takes by name (which would reach it as None, or as the text "None"). DatasetRowError names the
rows and what to fix; the CLI exits with code 2.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any

from rlspec.rollout.limits import check_prompt_lengths, prompt_too_long_error

logger = logging.getLogger(__name__)
CHUNK = 512  # conversations templated per tokenizer call
SHOWN = 5  # bad rows named in an error
# what TRL passes every reward function itself: not dataset columns
_REWARD_ARGS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "kwargs",
                "self", "environments"}


class DatasetRowError(ValueError):
    """Rows of the train dataset no step could use; the message names them. exit_code: the CLI's (before step 1)."""

    exit_code = 2


def prompt_lengths(dataset, tokenizer, *, column: str = "prompt", chat_template: str | None = None,
                   tools: list | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token count of every row's prompt as TRL's GRPOTrainer feeds it to generation (_tokenize_prompts):
    chat_template / tools / chat_template_kwargs as the trainer holds them (TRL's args of the same names)."""
    return [len(x) for x in prompt_ids(dataset, tokenizer, column=column, chat_template=chat_template, tools=tools,
                                       chat_template_kwargs=chat_template_kwargs)]


def prompt_ids(dataset, tokenizer, *, column: str = "prompt", chat_template: str | None = None,
               tools: list | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> list[list[int]]:
    """Every row's prompt token ids as TRL's GRPOTrainer tokenizes them for generation; a row whose prompt is
    missing or empty is refused first (DatasetRowError)."""
    from trl.data_utils import is_conversational

    if column not in dataset.column_names:
        raise ValueError(f"the train dataset has no {column!r} column (columns: {dataset.column_names}); "
                         "TRL's trainers read prompts from it")
    prompts = list(dataset[column])
    empty = [i for i, p in enumerate(prompts) if _empty(p)]
    if empty:
        raise DatasetRowError(f"{_rows(empty, len(prompts), dataset)} of the train dataset {'has' if len(empty) == 1 else 'have'} "
                              f"an empty or missing {column!r} (None, blank text, or messages without content): no "
                              "rollout can start from it. Remove or fill these rows before training.")
    ids: list[list[int]] = []
    for start in range(0, len(prompts), CHUNK):
        chunk = prompts[start:start + CHUNK]
        if is_conversational({"prompt": chunk[0]}):
            got = tokenizer.apply_chat_template(conversation=chunk, tools=tools or None, chat_template=chat_template,
                                                add_generation_prompt=True, tokenize=True, return_dict=True,
                                                **(chat_template_kwargs or {}))["input_ids"]
        else:
            got = tokenizer(text=chunk)["input_ids"]
        ids.extend(list(x) for x in got)
    return ids


def _empty(prompt) -> bool:
    if prompt is None:
        return True
    if isinstance(prompt, str):
        return not prompt.strip()
    if isinstance(prompt, (list, tuple)):
        texts = [m.get("content") for m in prompt if isinstance(m, dict)] if prompt else []
        return not any((t.strip() if isinstance(t, str) else t) for t in texts)
    return False


def _rows(rows: list[int], total: int, dataset=None) -> str:
    shown = ", ".join(map(str, rows[:SHOWN])) + (f", ... ({len(rows)} of {total})" if len(rows) > SHOWN else "")
    source = _source_rows(dataset, rows[:SHOWN])
    where = f" (row{'s' if len(rows) > 1 else ''} {', '.join(map(str, source))} of the data as loaded, before " \
            "the run's seeded shuffle and selection)" if source is not None and source != rows[:SHOWN] else ""
    return f"row{'s' if len(rows) > 1 else ''} {shown}{where}"


def _source_rows(dataset, rows: list[int]) -> list[int] | None:
    """The rows of the data as loaded that a shuffled or selected datasets.Dataset's rows come from (its indices
    mapping), so a message names the row of the user's file; None for data without one."""
    indices = getattr(dataset, "_indices", None)
    if indices is None:
        return None
    try:
        column = indices.column(0)
        return [int(column[i].as_py()) for i in rows]
    except Exception:  # noqa: BLE001 - a private mapping of another datasets version: name the rows as they are
        return None


def check_rows(dataset, ids: list[list[int]], *, vocab_size: int | None = None, reward_funcs=(),
               column: str = "prompt") -> None:
    """Refuse (DatasetRowError) a templated prompt with no tokens, a token id outside [0, vocab_size), and None
    in a dataset column a reward function takes by name."""
    empty = [i for i, x in enumerate(ids) if not x]
    if empty:
        raise DatasetRowError(f"{_rows(empty, len(ids), dataset)} of the train dataset tokenize to no token at all: fill the "
                              f"{column!r} of these rows or remove them.")
    if vocab_size is not None:
        out = [(i, t) for i, x in enumerate(ids) for t in (max(x), min(x)) if t >= vocab_size or t < 0]
        if out:
            rows = list(dict.fromkeys(i for i, _ in out))
            raise DatasetRowError(
                f"{_rows(rows, len(ids), dataset)} of the train dataset hold token id {out[0][1]} (row {out[0][0]}), outside "
                f"the model's vocabulary of {vocab_size} ids: the tokenizer has tokens the model has no embedding "
                "for (tokens added after the model was built?). Use the model's own tokenizer, resize the model's "
                "embeddings (model.resize_token_embeddings), or remove these rows.")
    for column_name in reward_columns(reward_funcs, dataset.column_names):
        nones = [i for i, v in enumerate(dataset[column_name]) if v is None]
        if nones:
            raise DatasetRowError(f"{_rows(nones, len(dataset), dataset)} of the train dataset have None in {column_name!r}, "
                                  f"which a reward function takes: fill or remove these rows before training.")


def reward_columns(reward_funcs, columns) -> list[str]:
    """The dataset columns the reward functions name as parameters (TRL passes every column by name)."""
    named: list[str] = []
    for f in reward_funcs or ():
        if not callable(f) or hasattr(f, "forward"):  # a reward model reads no columns by name
            continue
        try:
            params = inspect.signature(f).parameters
        except (TypeError, ValueError):
            continue
        named += [n for n, p in params.items() if n not in _REWARD_ARGS and n in columns
                  and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    return list(dict.fromkeys(named))


def check_dataset_prompts(dataset, tokenizer, max_model_len: int, *, max_new_tokens_min: int = 1,
                          drop: bool = False, vocab_size: int | None = None, reward_funcs=(), **tokenize: Any):
    """Check that every prompt of `dataset` leaves `max_new_tokens_min` tokens of room in a context of
    `max_model_len` (the rollout engine's). Returns (dataset, dropped): the dataset unchanged and 0 when all
    fit; with drop=True the dataset without the rows that do not (datasets.Dataset.select) and how many went.
    Otherwise raises rollout.errors.PromptTooLongError naming the first rows (index, length). Rows no step could
    use raise DatasetRowError first (check_rows: vocab_size, the model's; reward_funcs, the trainer's).

    tokenize: column, chat_template, tools, chat_template_kwargs (see prompt_lengths). A dataset without a
    length (a streaming IterableDataset) cannot be checked without consuming it: it is returned unchecked."""
    if dataset is None or not hasattr(dataset, "__len__"):
        return dataset, 0
    ids = prompt_ids(dataset, tokenizer, **tokenize)
    check_rows(dataset, ids, vocab_size=vocab_size, reward_funcs=reward_funcs, column=tokenize.get("column", "prompt"))
    lengths = [len(x) for x in ids]
    long = check_prompt_lengths(lengths, max_model_len, max_new_tokens_min)
    if not long:
        return dataset, 0
    if not drop:
        raise prompt_too_long_error(
            [(i, lengths[i]) for i in long], max_model_len, total=len(lengths), where="the rollout engine's",
            min_new_tokens=max_new_tokens_min,
            fix=f"or drop {'this row' if len(long) == 1 else f'these {len(long)} rows'} before training "
                "(data.drop_long_prompts: true)")
    bad = set(long)
    kept = dataset.select([i for i in range(len(lengths)) if i not in bad])
    logger.warning("dropped %d of %d prompts with no room for %d new token(s) in the rollout context of %d tokens",
                   len(long), len(lengths), max_new_tokens_min, max_model_len)
    return kept, len(long)


def check_trainer_prompts(trainer, max_model_len: int, *, drop: bool = False, max_new_tokens_min: int = 1) -> int:
    """check_dataset_prompts on a TRL trainer's train_dataset, tokenized with the trainer's own processing
    class, chat template, tools and chat_template_kwargs; with drop=True the trainer's train_dataset is
    replaced by the filtered one (TRL builds its dataloader from it in train()). Returns how many were dropped."""
    trainer.train_dataset, dropped = check_dataset_prompts(
        trainer.train_dataset, trainer.processing_class, max_model_len, max_new_tokens_min=max_new_tokens_min,
        drop=drop, chat_template=getattr(trainer, "chat_template", None), tools=getattr(trainer, "tools", None),
        chat_template_kwargs=getattr(trainer, "chat_template_kwargs", None), vocab_size=model_vocab_size(trainer.model),
        reward_funcs=getattr(trainer, "reward_funcs", ()))
    return dropped


def model_vocab_size(model) -> int | None:
    """How many token ids the model embeds (its input embedding's rows; else its config's vocab_size)."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError, NotImplementedError):
        return getattr(getattr(model, "config", None), "vocab_size", None)
