"""Preflight: what can be checked before step 1 is checked before step 1.

A prompt too long for the rollout engine's context used to surface when the sampler first drew its row,
possibly hours into a run. `check_dataset_prompts` tokenizes every prompt of the train dataset the way TRL
will (conversations through the chat template with the generation prompt, plain text as it is; TRL 1.16's
GRPOConfig has no prompt truncation, so the whole prompt reaches the engine) and applies the engine's own
length rule (rollout/limits.py). It raises PromptTooLongError naming the offending rows, or, when asked,
drops them and says how many. Cost: one tokenization of the dataset, at construction.
"""
from __future__ import annotations

import logging
from typing import Any

from rlspec.rollout.limits import check_prompt_lengths, prompt_too_long_error

logger = logging.getLogger(__name__)
CHUNK = 512  # conversations templated per tokenizer call


def prompt_lengths(dataset, tokenizer, *, column: str = "prompt", chat_template: str | None = None,
                   tools: list | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token count of every row's prompt as TRL's GRPOTrainer feeds it to generation (_tokenize_prompts):
    chat_template / tools / chat_template_kwargs as the trainer holds them (TRL's args of the same names)."""
    from trl.data_utils import is_conversational

    if column not in dataset.column_names:
        raise ValueError(f"the train dataset has no {column!r} column (columns: {dataset.column_names}); "
                         "TRL's trainers read prompts from it")
    prompts = list(dataset[column])
    lengths: list[int] = []
    for start in range(0, len(prompts), CHUNK):
        chunk = prompts[start:start + CHUNK]
        if is_conversational({"prompt": chunk[0]}):
            ids = tokenizer.apply_chat_template(conversation=chunk, tools=tools or None, chat_template=chat_template,
                                                add_generation_prompt=True, tokenize=True, return_dict=True,
                                                **(chat_template_kwargs or {}))["input_ids"]
        else:
            ids = tokenizer(text=chunk)["input_ids"]
        lengths.extend(len(x) for x in ids)
    return lengths


def check_dataset_prompts(dataset, tokenizer, max_model_len: int, *, max_new_tokens_min: int = 1,
                          drop: bool = False, **tokenize: Any):
    """Check that every prompt of `dataset` leaves `max_new_tokens_min` tokens of room in a context of
    `max_model_len` (the rollout engine's). Returns (dataset, dropped): the dataset unchanged and 0 when all
    fit; with drop=True the dataset without the rows that do not (datasets.Dataset.select) and how many went.
    Otherwise raises rollout.errors.PromptTooLongError naming the first rows (index, length).

    tokenize: column, chat_template, tools, chat_template_kwargs (see prompt_lengths). A dataset without a
    length (a streaming IterableDataset) cannot be checked without consuming it: it is returned unchecked."""
    if dataset is None or not hasattr(dataset, "__len__"):
        return dataset, 0
    lengths = prompt_lengths(dataset, tokenizer, **tokenize)
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
        chat_template_kwargs=getattr(trainer, "chat_template_kwargs", None))
    return dropped
