"""PPOConfig: transformers.TrainingArguments plus PPO's knobs, in TRL's conventions.

Names follow the former `trl.PPOConfig` (TRL <= 0.2x) where it had the field (num_ppo_epochs,
num_mini_batches, whiten_rewards, kl_coef, kl_estimator, cliprange, vf_coef, cliprange_value, gamma,
lam, temperature, missing_eos_penalty, stop_token_id) and TRL's GRPOConfig otherwise
(max_completion_length, num_generations); the importance-sampling fields are GRPOConfig's
vllm_importance_sampling_{correction,mode,clip_max} without the "vllm_" (there is no vLLM here).

Batch shape of one training step (one rollout, then its PPO epochs):
    rollout batch  = per_device_train_batch_size * num_mini_batches completions
                   = that / num_generations prompts, each sampled num_generations times
    one minibatch  = per_device_train_batch_size completions -> one optimizer update
    updates / step = num_ppo_epochs * num_mini_batches
`global_step` counts rollouts (as verl and the former TRL trainer did), so max_steps=30 is 30 rollouts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from transformers import TrainingArguments


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class PPOConfig(TrainingArguments):
    """Configuration for `rlspec.trainers.ppo.trainer.PPOTrainer` (every field below is read by the trainer)."""

    model_init_kwargs: dict | None = field(default=None, metadata=_help(
        "keyword arguments of AutoModelForCausalLM.from_pretrained when the model is given by name "
        "(e.g. {'dtype': 'float32'}: keep float32 master weights under bf16 autocast)"))
    # Rollouts
    num_generations: int = field(default=4, metadata=_help("completions sampled per prompt"))
    max_completion_length: int = field(default=256, metadata=_help("max new tokens per completion (TRL's "
                                                                   "former response_length)"))
    temperature: float = field(default=1.0, metadata=_help("sampling temperature; logprobs are taken from the "
                                                           "temperature-scaled distribution, as sampled"))
    stop_token_id: int | None = field(default=None, metadata=_help("token that ends a completion besides the "
                                                                   "tokenizer's and generation config's EOS"))
    missing_eos_penalty: float | None = field(default=None, metadata=_help(
        "subtracted from the score of a completion that hit max_completion_length without a stop token"))
    max_model_len: int | None = field(default=None, metadata=_help(
        "prompt + completion tokens the engine holds per sequence (None: the model's limit, at most 2048)"))
    # PPO
    num_ppo_epochs: int = field(default=4, metadata=_help("passes over each rollout batch"))
    num_mini_batches: int = field(default=1, metadata=_help("minibatches (optimizer updates) per pass"))
    cliprange: float = field(default=0.2, metadata=_help("policy ratio clip epsilon"))
    vf_coef: float = field(default=0.1, metadata=_help("weight of the value loss in the total loss"))
    cliprange_value: float = field(default=0.2, metadata=_help("value prediction clip around the old values"))
    gamma: float = field(default=1.0, metadata=_help("discount factor of GAE"))
    lam: float = field(default=0.95, metadata=_help("lambda of GAE (1 = Monte Carlo, 0 = one-step TD)"))
    value_lam: float | None = field(default=None, metadata=_help(
        "lambda of the value model's GAE returns (None: lam). VAPO's decoupled GAE uses 1.0: with an outcome "
        "reward at the last token and lam < 1, a token T steps before the end sees lam**T of the reward and "
        "bootstraps the rest from the critic itself, so the critic hardly learns (docs/ppo.md)"))
    whiten_rewards: bool = field(default=False, metadata=_help("whiten per-token rewards (keeping their mean) "
                                                               "before GAE"))
    whiten_advantages: bool = field(default=True, metadata=_help("whiten advantages over the batch"))
    # KL to the reference policy (a frozen copy of the initial policy; none when kl_coef is 0)
    kl_coef: float = field(default=0.05, metadata=_help("KL coefficient (0 = no reference model)"))
    kl_estimator: Literal["k1", "k3"] = field(default="k1", metadata=_help("per-token KL estimator"))
    kl_in_reward: bool = field(default=True, metadata=_help(
        "True: -kl_coef * KL is a per-token reward (InstructGPT, former TRL); False: kl_coef * KL is added to "
        "the loss (verl's use_kl_loss)"))
    # Value model
    value_model: Literal["head", "separate"] = field(default="head", metadata=_help(
        "head: a linear value head on the policy's backbone (one forward for both); separate: a critic = copy "
        "of the policy's backbone + head, trained alongside"))
    value_warmup_steps: int = field(default=0, metadata=_help(
        "the first this many steps (rollouts) train the value model only and leave the policy as it is (verl's "
        "critic_warmup, VAPO's value pre-training); with value_model='head' only the head moves"))
    value_learning_rate: float | None = field(default=None, metadata=_help(
        "learning rate of the value head/critic (None: learning_rate); a fresh head learns faster with more"))
    # Importance sampling against the engine's logprobs
    importance_sampling_correction: bool = field(default=True, metadata=_help(
        "weight each token's policy loss by pi_old/pi_engine (truncated); also logs TRL's sampling/* metrics"))
    importance_sampling_mode: Literal["token_truncate", "token_mask"] = field(default="token_truncate",
                                                                              metadata=_help("truncate or mask"))
    importance_sampling_cap: float = field(default=2.0, metadata=_help("upper bound of the importance weight"))
    # TrainingArguments defaults TRL's trainers change
    remove_unused_columns: bool = field(default=False, metadata=_help(
        "keep dataset columns: reward functions receive them as keyword arguments"))
    logging_steps: float = field(default=1, metadata=_help("log every this many steps"))

    def __post_init__(self) -> None:
        super().__post_init__()
        _validate(self)


def _validate(args: PPOConfig) -> None:
    """Every PPO-specific constraint, with the fix in the message."""
    rollout = args.per_device_train_batch_size * args.num_mini_batches
    checks = [
        (args.num_generations >= 1, f"num_generations must be >= 1, got {args.num_generations}"),
        (rollout % args.num_generations == 0,
         f"per_device_train_batch_size * num_mini_batches ({rollout}) completions per rollout must be a multiple of "
         f"num_generations ({args.num_generations}) so every prompt gets all its samples"),
        (args.gradient_accumulation_steps == 1,
         "PPOTrainer makes num_ppo_epochs * num_mini_batches optimizer updates inside each step: set "
         "gradient_accumulation_steps=1 and size an update with per_device_train_batch_size"),
        (args.num_ppo_epochs >= 1 and args.num_mini_batches >= 1, "num_ppo_epochs and num_mini_batches must be >= 1"),
        (args.cliprange > 0 and args.cliprange_value > 0, "cliprange and cliprange_value must be > 0"),
        (0 <= args.gamma <= 1 and 0 <= args.lam <= 1, f"gamma and lam must be in [0, 1], got {args.gamma}, {args.lam}"),
        (args.value_lam is None or 0 <= args.value_lam <= 1, f"value_lam must be in [0, 1] or None, got {args.value_lam}"),
        (args.value_warmup_steps >= 0, f"value_warmup_steps must be >= 0, got {args.value_warmup_steps}"),
        (args.kl_coef >= 0, f"kl_coef must be >= 0, got {args.kl_coef}"),
        (args.kl_estimator in ("k1", "k3"), f"kl_estimator must be 'k1' or 'k3', got {args.kl_estimator!r}"),
        (args.value_model in ("head", "separate"), f"value_model must be 'head' or 'separate', got {args.value_model!r}"),
        (args.importance_sampling_mode in ("token_truncate", "token_mask"),
         f"importance_sampling_mode must be 'token_truncate' or 'token_mask', got {args.importance_sampling_mode!r}"),
        (args.importance_sampling_cap >= 1, f"importance_sampling_cap must be >= 1, got {args.importance_sampling_cap}"),
        (args.temperature > 0, f"temperature must be > 0 (logprobs divide by it), got {args.temperature}"),
        (args.max_completion_length >= 1, f"max_completion_length must be >= 1, got {args.max_completion_length}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
