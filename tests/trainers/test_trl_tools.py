"""SpecGRPOTrainer with TRL's tool loop: `tools=` and `environment_factory` (trl 1.16), every turn on the engine.

A random tiny model never writes a tool call, so the first turn is scripted: the engine's generate answers a
prompt without a tool response with a fixed `add(2, 3)` call (its logprobs computed by the policy itself, as the
engine would report them). TRL then runs the tool, appends its output and calls our _generate_single_turn for
the next turn, which the real engine samples. TRL's recomputed logprobs must equal the sampling logprobs over
every model token of both turns (the tool's output is masked out), which fails if a turn's tokens or logprobs
are misplaced or the tool turn did not reach the engine.
"""
from __future__ import annotations

import pytest
import torch
import trl

from rlspec.rollout.types import RolloutResult
from tests.trainers.conftest import build_char_tokenizer, build_tiny_llama
from rlspec.trainers.data import make_math_dataset
from rlspec.trainers.grpo import SpecGRPOTrainer
from rlspec.trainers.trl_compat import ENGINE_METRIC

TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
TOOL_RESULT = "<tool_response>\n5\n</tool_response>"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


class AdderEnv:
    """An environment_factory environment: its public methods are the tools, `reset` starts an episode."""

    def reset(self, **kwargs):
        self.total = None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.total = a + b
        return self.total


def env_reward(environments, **kwargs):
    return [float(env.total or 0) for env in environments]


def length_reward(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


@pytest.fixture
def tool_tokenizer():
    """The character tokenizer with Qwen2.5's chat template, which renders tools and TRL parses tool calls of."""
    from trl.chat_template_utils import qwen2_5_chat_template

    tok = build_char_tokenizer()
    tok.chat_template = qwen2_5_chat_template
    return tok


def script_first_turn(trainer, tokenizer) -> list[list[int]]:
    """Make the engine answer every first-turn prompt with TOOL_CALL; later turns go to the real engine, and their
    prompts are recorded in the returned list."""
    engine, real_generate = trainer.engine, trainer.engine.generate
    call_ids = tokenizer.encode(TOOL_CALL, add_special_tokens=False)
    tool_turns: list[list[int]] = []

    def policy_logprobs(prompt: list[int]) -> list[float]:
        ids = torch.tensor([prompt + call_ids])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / trainer.temperature
        return logits.log_softmax(-1).gather(-1, torch.tensor(call_ids)[:, None])[:, 0].tolist()

    def generate(prompt_ids, params, use_tqdm=False, **kw):
        if TOOL_RESULT in tokenizer.decode(prompt_ids[0]):
            tool_turns.extend(prompt_ids)
            return real_generate(prompt_ids, params, **kw)
        return [RolloutResult(prompt_ids=list(p), completion_ids=list(call_ids), logprobs=policy_logprobs(list(p)),
                              finish_reason="stop", policy_version=engine.policy_version, prompt_index=i,
                              sample_index=j)
                for i, p in enumerate(prompt_ids) for j in range(params.n)]

    engine.generate = generate
    return tool_turns


def tool_trainer(tokenizer, tmp_path, **kwargs) -> SpecGRPOTrainer:
    model = build_tiny_llama(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    model.config.max_position_embeddings = 2048  # Qwen2.5's system prompt with a tool schema is long in characters
    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, seed=0,
                          per_device_train_batch_size=2, num_generations=2, max_completion_length=128, max_steps=1,
                          logging_steps=1, learning_rate=1e-2,
                          report_to="none", save_strategy="no", disable_tqdm=True)
    return SpecGRPOTrainer(model=model, args=args, train_dataset=make_math_dataset(4, seed=0),
                           processing_class=tokenizer, engine_kwargs=dict(max_model_len=2048, max_num_seqs=4), **kwargs)


def check_tool_step(trainer, tool_turns: list[list[int]], tokenizer) -> None:
    log = next(log for log in trainer.state.log_history if "reward" in log)
    assert log["tools/call_frequency"] == 1.0 and log["tools/failure_frequency"] == 0.0
    assert log[ENGINE_METRIC] == 1.0
    # the tool turn went to the engine: one prompt per sample, each holding the tool's output
    assert len(tool_turns) == 2 and all(TOOL_RESULT in tokenizer.decode(p) for p in tool_turns)
    # both turns' model tokens were sampled by the law TRL trains: scripted call + engine's post-tool turn
    assert log["sampling/sampling_logp_difference/max"] < 1e-4


def test_tools_run_every_turn_through_the_engine(tool_tokenizer, tmp_path):
    trainer = tool_trainer(tool_tokenizer, tmp_path, reward_funcs=[length_reward], tools=[add])
    tool_turns = script_first_turn(trainer, tool_tokenizer)
    trainer.train()
    check_tool_step(trainer, tool_turns, tool_tokenizer)


def test_environment_factory_runs_through_the_engine(tool_tokenizer, tmp_path):
    trainer = tool_trainer(tool_tokenizer, tmp_path, reward_funcs=[env_reward], environment_factory=AdderEnv)
    tool_turns = script_first_turn(trainer, tool_tokenizer)
    trainer.train()
    check_tool_step(trainer, tool_turns, tool_tokenizer)
    assert all(env.total == 5 for env in trainer.environments)  # the environment's own tool ran


def test_a_tool_turn_past_the_engine_context_gets_no_tokens(tool_tokenizer, tmp_path):
    """TRL drops a tool result only past max_position_embeddings (2048 here); the engine's context is shorter, so
    the tool turn's prompt does not fit it: the turn ends with no tokens instead of the engine refusing the step."""
    dataset = make_math_dataset(4, seed=0)
    longest = max(len(tool_tokenizer.apply_chat_template(p, tools=[add], add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)) for p in dataset["prompt"])
    context = longest + 24  # the first turn fits (the preflight checks it); prompt + call + tool output does not
    trainer = tool_trainer(tool_tokenizer, tmp_path, reward_funcs=[length_reward], tools=[add])
    trainer.rollouts.max_model_len = trainer.engine.max_model_len = context
    tool_turns = script_first_turn(trainer, tool_tokenizer)
    trainer.train()
    log = next(log for log in trainer.state.log_history if "reward" in log)
    assert log["tools/call_frequency"] == 1.0 and tool_turns == []
