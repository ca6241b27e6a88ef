"""The actor-critic module PPO trains: the policy plus a value model, as one nn.Module.

One module, so accelerate/DDP/DeepSpeed wrap, shard and all-reduce the policy and the value model
together and the Trainer's optimizer sees both. Two value models (PPOConfig.value_model):
- "head": a linear head on the policy's own last hidden state. One forward yields logits and values;
  the value loss also shapes the shared backbone (verl's and the former TRL trainer's cheap option).
- "separate": a critic = a copy of the policy's backbone (initialised from it) + a linear head, as
  verl's critic; twice the memory, no interference between the two losses.
The head starts at zero, so the first values are 0 and the first advantages are pure returns.

Saving: the policy stays a plain Hugging Face directory (what the engine, vLLM and export load);
the value model goes beside it in `value_model.safetensors` (VALUE_FILE), which resume reads back.
"""
from __future__ import annotations

import copy
import os

import torch
from torch import nn

from rlspec.trainers import checkpointing

VALUE_FILE = "value_model.safetensors"


def backbone_of(policy: nn.Module) -> nn.Module:
    """The decoder stack under an HF causal LM (`model` for Llama-family, `transformer` for GPT-2...)."""
    return getattr(policy, policy.base_model_prefix)


def completion_hidden(backbone: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      completion_len: int) -> torch.Tensor:
    """(B, T, H) last hidden states one position left of each completion token: the state that predicts
    token t (its logits) and the state before token t (its value)."""
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return hidden[:, -completion_len - 1:-1]


def completion_logits(policy: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      completion_len: int) -> torch.Tensor:
    """(B, T, V) logits of the completion tokens only (the LM head never runs over the prompt)."""
    hidden = completion_hidden(backbone_of(policy), input_ids, attention_mask, completion_len)
    return policy.get_output_embeddings()(hidden)


class PolicyAndValue(nn.Module):
    """policy: an HF causal LM; value_model: "head" or "separate" (module docstring)."""

    def __init__(self, policy: nn.Module, value_model: str = "head"):
        super().__init__()
        self.policy = policy
        self.critic = copy.deepcopy(backbone_of(policy)) if value_model == "separate" else None
        hidden = policy.config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=next(policy.parameters()).dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):  # the Trainer and TRL helpers read model.config
        return self.policy.config

    @property
    def _keys_to_ignore_on_save(self) -> list[str]:
        """Tied weights save_pretrained leaves out; the Trainer re-ties them after loading a checkpoint."""
        tied = getattr(self.policy, "_tied_weights_keys", None) or {}
        return list(tied) if getattr(self.policy.config.get_text_config(), "tie_word_embeddings", False) else []

    def tie_weights(self) -> None:
        self.policy.tie_weights()

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, **options) -> None:
        for model in (self.policy, self.critic):
            if model is not None:
                checkpointing.enable(model, activation_checkpointing_kwargs, **options)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **options) -> None:
        """The name the Trainer calls before transformers 5.24 (trainers/checkpointing.py)."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **options)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                value_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, values) for the last `completion_len` tokens of each row.

        input_ids, attention_mask: (B, P + T) prompts left-padded, completions right-padded.
        logits: (B, T, V), position t predicting completion token t; values: (B, T), V(state before
        token t), i.e. both read the hidden state one position to the left of the token.
        value_only: the value loss alone will be back-propagated (critic warm-up): the head reads the
        policy's hidden states detached, so the policy gets no gradient and stays as it is.
        """
        hidden = completion_hidden(backbone_of(self.policy), input_ids, attention_mask, completion_len)
        logits = self.policy.get_output_embeddings()(hidden)
        if self.critic is not None:
            hidden = completion_hidden(self.critic, input_ids, attention_mask, completion_len)
        elif value_only:
            hidden = hidden.detach()
        return logits, self.value_head(hidden).squeeze(-1).float()

    def load_value_model(self, checkpoint_dir: str) -> None:
        from safetensors.torch import load_file

        path = os.path.join(checkpoint_dir, VALUE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: the checkpoint has no value model (was it written by "
                                    "PPOTrainer with the same value_model setting?)")
        missing, unexpected = self.load_state_dict(load_file(path), strict=False)
        missing = [k for k in missing if not k.startswith("policy.")]
        if missing or unexpected:
            raise ValueError(f"{path} does not match value_model: missing {missing[:3]}, unexpected {unexpected[:3]}")
