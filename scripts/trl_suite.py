"""TRL compatibility harness (tracker issue 28): TRL's own GRPOTrainer tests, plain vs SpecGRPOTrainer.

Runs TRL's tests/test_grpo_trainer.py twice with pytest, offline:
  plain  the test module as written (trl.GRPOTrainer);
  spec   the name `GRPOTrainer` in the test module bound to a thin subclass of trainers.grpo.SpecGRPOTrainer
         that records whether each test's rollouts came back from rlspec's engine (scripts/trl_suite_plugin.py).
The issue's bar: no test passing on plain fails on spec, and >= 68 spec-passing tests sample through the engine.

Getting TRL's tests (CI has no network, so they are passed in; TRL's test code is never vendored here):
    git clone https://github.com/huggingface/trl && git -C trl checkout v1.16.0   # the installed trl version
    python scripts/trl_suite.py --trl-tests trl/tests
`--trl-tests` is that checkout's tests/ directory (test_grpo_trainer.py, testing_utils.py, conftest.py, ...).
It is copied into the work directory; nothing in it is edited.

The Hub is not used. Before the runs the driver builds, under --work:
  - every `trl-internal-testing/tiny-*` text model the test file names that has a recipe below (the
    architectures and tiny shapes of TRL's scripts/generate_tiny_models; random weights; the SmolLM2 tokenizer
    from rlspec's cache, `python -m rollout.runtime.model.fetch smollm2-135m-instruct`, with the family's chat
    template from trl/chat_templates and its special tokens added), saved as a Hugging Face hub cache
    (HF_HOME=<work>/hf_home, HF_HUB_OFFLINE=1) so the repo ids resolve unchanged;
  - the `trl-internal-testing/zen` configs the tests load (standard_prompt_only, conversational_prompt_only;
    the Zen of Python, 17 train / 2 test rows), redirected from `datasets.load_dataset` by the plugin.
Repo ids without a recipe (vision-language models, remote-code models, image datasets) are listed in the
output with the reason, and a test failing because it needs one is reported as skipped in both arms.

Output: --out (default bench_out/trl_suite.json): per-test outcome of both arms, whether each spec test
sampled through the engine, summary counts, wall times, and the tests passing on plain but failing on spec
with the first line of the error; a summary table is printed.

    python scripts/trl_suite.py --trl-tests /tmp/trl_tests                       # both arms, everything
    python scripts/trl_suite.py --trl-tests /tmp/trl_tests -k "TestGRPOTrainer and loss_type"   # a subset
    python scripts/trl_suite.py --report-only --out bench_out/trl_suite.json     # re-print a saved result
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST_FILE = "test_grpo_trainer.py"
ENGINE_BAR = 68  # issue 28: at least this many spec-passing tests sample through the engine
OUTCOMES = ("passed", "failed", "error", "skipped")


# ----------------------------------------------------------------------------------------------- pure logic
def junit_key(classname: str, name: str) -> str:
    """'Class::test[param]' (or 'test[param]' for a module-level test) from a JUnit testcase's attributes."""
    last = classname.rsplit(".", 1)[-1] if classname else ""
    if last.startswith("Test"):
        return f"{last}::{name}"
    return name


def nodeid_key(nodeid: str) -> str:
    """The same key from a pytest nodeid ('dir/test_x.py::Class::test[param]')."""
    return nodeid.split("::", 1)[1] if "::" in nodeid else nodeid


def first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            return line[:300]
    return ""


def parse_junit(xml_text: str) -> dict[str, dict]:
    """{key: {"outcome": passed|failed|error|skipped, "message": first line, "time_s": float}} from JUnit XML.

    A testcase with both a failure and an error (a failing test whose teardown also errs) counts as failed;
    a setup/teardown error alone counts as error."""
    root = ET.fromstring(xml_text)
    out: dict[str, dict] = {}
    for case in root.iter("testcase"):
        key = junit_key(case.get("classname", ""), case.get("name", ""))
        outcome, message = "passed", ""
        for tag in ("skipped", "error", "failure"):  # later tags take precedence
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = first_line(el.get("message")) or first_line(el.text)
        out[key] = {"outcome": outcome, "message": message, "time_s": round(float(case.get("time") or 0.0), 2)}
    return out


def parse_engine_log(text: str) -> dict[str, dict]:
    """{key: {"constructed", "engine_calls", "engine_samples"}} from the plugin's JSON-lines log."""
    out = {}
    for line in text.splitlines():
        if line.strip():
            rec = json.loads(line)
            out[nodeid_key(rec["nodeid"])] = {k: rec.get(k, 0) for k in ("constructed", "on_trl_generation", "engine_calls",
                                                                   "engine_samples")}
    return out


def counts(results: dict[str, dict]) -> dict[str, int]:
    c = Counter(r["outcome"] for r in results.values())
    return {"total": len(results), **{o: c.get(o, 0) for o in OUTCOMES}}


def regressions(plain: dict[str, dict], spec: dict[str, dict]) -> list[dict]:
    """Tests passing on plain that do not pass on spec (skipped-on-spec counts too: it did not pass)."""
    out = []
    for key, p in sorted(plain.items()):
        s = spec.get(key)
        if p["outcome"] == "passed" and (s is None or s["outcome"] != "passed"):
            out.append({"test": key, "spec_outcome": s["outcome"] if s else "missing",
                        "error": s["message"] if s else "not run on spec"})
    return out


def group_by_cause(regs: list[dict]) -> dict[str, list[str]]:
    """Regressions grouped by their first error line, numbers and quoted values blurred so that the same
    cause with different parameters lands in one group."""
    groups: dict[str, list[str]] = defaultdict(list)
    for r in regs:
        cause = re.sub(r"\d+(\.\d+)?", "N", r["error"] or r["spec_outcome"])
        groups[cause[:200]].append(r["test"])
    return dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))


# a failure whose last error says a file was not found offline (the model or dataset was not built)
OFFLINE_MISS = re.compile(r"couldn't connect to 'https://huggingface.co'|LocalEntryNotFoundError|not built offline|"
                          r"Cannot find the requested files in the disk cache|OfflineModeIsEnabled", re.I)


def test_sources(test_file: Path) -> dict[str, str]:
    """{'Class::test_name' or 'test_name': source text, decorators included} of every test function."""
    import ast

    src = test_file.read_text()
    lines = src.splitlines()
    out: dict[str, str] = {}

    def add(node, prefix: str) -> None:
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        out[prefix + node.name] = "\n".join(lines[start - 1:node.end_lineno])

    for node in ast.parse(src).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            add(node, "")
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name.startswith("test"):
                    add(sub, f"{node.name}::")
    return out


def unbuilt_needed(key: str, sources: dict[str, str], unbuilt: dict[str, str]) -> list[str]:
    """The not-built repo ids a test names: in its parameters (the nodeid) or in its own source."""
    base = key.split("[", 1)[0]
    params = key[len(base):]
    body = sources.get(base, "")
    return [rid for rid in sorted(unbuilt, key=len, reverse=True)
            if re.search(re.escape(rid) + r"(?![A-Za-z0-9_.\-])", params + "\n" + body)]


def reclassify_unbuilt(results: dict[str, dict], sources: dict[str, str], unbuilt: dict[str, str]) -> int:
    """Failures caused by a model or dataset that was not built offline become skips (the same rule for both
    arms): the error says a file was missing offline and the test names a not-built repo id. Returns how many."""
    n = 0
    for key, r in results.items():
        if r["outcome"] in ("failed", "error") and OFFLINE_MISS.search(r["message"] or ""):
            ids = unbuilt_needed(key, sources, unbuilt)
            if ids:
                r.update(outcome="skipped", message=f"not built offline: {ids[0]} ({unbuilt[ids[0]]})",
                         original_message=r["message"])
                n += 1
    return n


def summarize(plain: dict[str, dict] | None, spec: dict[str, dict] | None, engine: dict[str, dict]) -> dict:
    summary: dict = {}
    if plain is not None:
        summary["plain"] = counts(plain)
    if spec is not None:
        summary["spec"] = counts(spec)
        passing = [k for k, r in spec.items() if r["outcome"] == "passed"]
        summary["spec_passing_sampled_through_engine"] = sum(engine.get(k, {}).get("engine_calls", 0) > 0 for k in passing)
        summary["spec_sampled_through_engine_any_outcome"] = sum(engine.get(k, {}).get("engine_calls", 0) > 0 for k in spec)
    if plain is not None and spec is not None:
        regs = regressions(plain, spec)
        summary["pass_on_plain_fail_on_spec"] = len(regs)
        summary["fixed_on_spec"] = sum(1 for k, r in spec.items()
                                       if r["outcome"] == "passed" and plain.get(k, {}).get("outcome") != "passed")
        summary["issue28_met"] = (len(regs) == 0 and summary["spec_passing_sampled_through_engine"] >= ENGINE_BAR)
    return summary


def per_test_table(plain: dict | None, spec: dict | None, engine: dict) -> dict[str, dict]:
    keys = sorted(set(plain or {}) | set(spec or {}))
    table = {}
    for k in keys:
        row = {}
        if plain is not None:
            row["plain"] = plain.get(k, {"outcome": "missing", "message": ""})
        if spec is not None:
            row["spec"] = spec.get(k, {"outcome": "missing", "message": ""})
            row["spec_sampled_through_engine"] = engine.get(k, {}).get("engine_calls", 0) > 0
            row["spec_engine"] = engine.get(k)
        table[k] = row
    return table


def format_summary(doc: dict) -> str:
    s = doc["summary"]
    lines = ["", f"TRL GRPOTrainer suite ({doc.get('trl_tests_source', '?')}, trl {doc.get('trl_version', '?')})",
             f"{'arm':8s} {'total':>6s} {'passed':>7s} {'failed':>7s} {'error':>6s} {'skipped':>8s} {'wall_s':>8s} {'test_s':>8s}"]
    for arm in ("plain", "spec"):
        if arm in s:
            c = s[arm]
            lines.append(f"{arm:8s} {c['total']:6d} {c['passed']:7d} {c['failed']:7d} {c['error']:6d} {c['skipped']:8d} "
                         f"{doc.get('wall_s', {}).get(arm, 0):8.0f} {doc.get('test_time_s', {}).get(arm, 0):8.0f}")
    w = doc.get("wall_s", {})
    if "total" in w:
        lines.append(f"wall: {w['total']:.0f}s in all ({w.get('fixtures', 0):.0f}s building fixtures); "
                     f"{doc.get('jobs', 1)} pytest processes at a time, so the arms' wall times overlap")
    if "spec_passing_sampled_through_engine" in s:
        lines.append(f"spec-passing tests that sampled through rlspec's engine: {s['spec_passing_sampled_through_engine']}"
                     f" (bar: {ENGINE_BAR})")
    if "pass_on_plain_fail_on_spec" in s:
        lines.append(f"pass on plain, not on spec: {s['pass_on_plain_fail_on_spec']}; fixed on spec: {s['fixed_on_spec']};"
                     f" issue 28 met: {s['issue28_met']}")
        for cause, tests in doc.get("regressions_by_cause", {}).items():
            lines.append(f"  [{len(tests)}] {cause}")
            for t in tests:
                lines.append(f"        {t}")
    if doc.get("unbuilt"):
        lines.append("not built offline (tests needing them are skipped in both arms):")
        for rid, why in doc["unbuilt"].items():
            lines.append(f"  {rid}: {why}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ offline fixtures
SMOLLM2 = "smollm2-135m-instruct"
QWEN_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# family: chat template (trl/chat_templates/<name>.jinja; None = keep SmolLM2's), bos/eos/pad, extra special
# tokens, the generation_config eos list
FAMILIES = {
    "qwen2_5": dict(template="qwen2_5", bos=None, eos="<|im_end|>", pad="<|endoftext|>", extra=QWEN_TOOL_TOKENS,
                    gen_eos=["<|im_end|>", "<|endoftext|>"]),
    "qwen3": dict(template="qwen3", bos=None, eos="<|im_end|>", pad="<|endoftext|>",
                  extra=QWEN_TOOL_TOKENS + ["<think>", "</think>"], gen_eos=["<|im_end|>", "<|endoftext|>"]),
    "llama3_2": dict(template="llama3_2", bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None,
                     extra=["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>", "<|end_of_text|>"],
                     gen_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    "mistral": dict(template=None, bos="<s>", eos="</s>", pad=None, extra=["[INST]", "[/INST]"], gen_eos=["</s>"]),
    "gemma": dict(template="gemma", bos="<bos>", eos="<eos>", pad="<pad>", extra=["<start_of_turn>", "<end_of_turn>"],
                  gen_eos=["<eos>", "<end_of_turn>"]),
    "cohere2": dict(template="cohere2", bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>",
                    extra=["<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>",
                           "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_THINKING|>", "<|END_THINKING|>"],
                    gen_eos=["<|END_OF_TURN_TOKEN|>"]),
    "glm4moe": dict(template="glm4moe", bos=None, eos="<|endoftext|>", pad="<|endoftext|>",
                    extra=["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
                           "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                           "</arg_value>", "<tool_response>", "</tool_response>"],
                    gen_eos=["<|endoftext|>", "<|user|>", "<|observation|>"]),
    "gptoss": dict(template="gptoss", bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>",
                   extra=["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|constrain|>"],
                   gen_eos=["<|return|>", "<|call|>"]),
    "nemotron_3_nano": dict(template="nemotron_3_nano", bos=None, eos="<|im_end|>", pad="<|endoftext|>",
                            extra=QWEN_TOOL_TOKENS + ["<think>", "</think>"], gen_eos=["<|im_end|>"]),
}
_TINY = dict(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32)
_TINY_CLS = dict(_TINY, hidden_size=16, num_labels=1)
# repo id (after "trl-internal-testing/") -> (config class, model class, config kwargs, family); shapes as in
# TRL's scripts/generate_tiny_models (vocab: the SmolLM2 tokenizer's plus the added tokens)
MODEL_RECIPES = {
    "tiny-Qwen2ForCausalLM-2.5": ("Qwen2Config", "Qwen2ForCausalLM", _TINY, "qwen2_5"),
    "tiny-Qwen2ForSequenceClassification-2.5": ("Qwen2Config", "Qwen2ForSequenceClassification", _TINY_CLS, "qwen2_5"),
    "tiny-Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM", _TINY, "qwen3"),
    "tiny-Qwen3ForSequenceClassification": ("Qwen3Config", "Qwen3ForSequenceClassification", _TINY_CLS, "qwen3"),
    "tiny-Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                 dict(_TINY, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True), "qwen3"),
    "tiny-LlamaForCausalLM-3.2": ("LlamaConfig", "LlamaForCausalLM", _TINY, "llama3_2"),
    "tiny-LlamaForSequenceClassification-3.2": ("LlamaConfig", "LlamaForSequenceClassification", _TINY_CLS, "llama3_2"),
    "tiny-MistralForCausalLM-0.2": ("MistralConfig", "MistralForCausalLM", _TINY, "mistral"),
    "tiny-Gemma2ForCausalLM": ("Gemma2Config", "Gemma2ForCausalLM", _TINY, "gemma"),
    "tiny-Cohere2ForCausalLM": ("Cohere2Config", "Cohere2ForCausalLM", dict(_TINY, logit_scale=1.0), "cohere2"),
    "tiny-Glm4MoeForCausalLM": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                                dict(_TINY, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                     first_k_dense_replace=1, n_group=1, topk_group=1), "glm4moe"),
    "tiny-GptOssForCausalLM": ("GptOssConfig", "GptOssForCausalLM",
                               dict(_TINY, num_local_experts=4, num_experts_per_tok=2), "gptoss"),
    "tiny-NemotronHForCausalLM-nano": ("NemotronHConfig", "NemotronHForCausalLM",
                                       dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                            intermediate_size=32, layers_block_type=["mamba", "attention", "moe"],
                                            mamba_num_heads=8, mamba_head_dim=4, mamba_n_groups=1, ssm_state_size=16,
                                            mamba_d_conv=4, mamba_expand=2, n_routed_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                                            use_mamba_kernels=False), "nemotron_3_nano"),
}
NO_RECIPE_REASONS = [
    (re.compile(r"ForConditionalGeneration|VL"), "vision-language model: needs the real image processor / processor "
                                                  "config, which is not available offline"),
    (re.compile(r"Remote"), "remote-code model: its modeling code lives on the Hub"),
    (re.compile(r"image"), "image dataset: no offline recipe"),
]
ZEN = [("Beautiful is better than", "What is beautiful better than?"),
       ("Explicit is", "What is explicit better than?"),
       ("Simple is better", "What is simple better than?"),
       ("Complex", "What is complex better than?"),
       ("Flat is better than", "What is flat better than?"),
       ("Sparse is better", "What is sparse better than?"),
       ("Readability", "What counts?"),
       ("Special cases aren't special", "Are special cases special enough to break the rules?"),
       ("Although practicality beats", "What beats purity?"),
       ("Errors should never", "What should errors never do?"),
       ("Unless explicitly", "When can errors pass silently?"),
       ("In the face of ambiguity, refuse", "What should you refuse in the face of ambiguity?"),
       ("There should be one-- and preferably", "How many obvious ways to do it should there be?"),
       ("Although that way may not be obvious at first unless you're", "Who finds the obvious way obvious at first?"),
       ("Now is", "Is now better than never?"),
       ("Although never is often", "Is never better than right now?"),
       ("If the implementation is hard to explain,", "What if the implementation is hard to explain?"),
       ("If the implementation is easy", "What if the implementation is easy to explain?"),
       ("Namespaces are one honking great", "What are namespaces?")]
ZEN_CONFIGS = {
    "standard_prompt_only": lambda: {"prompt": [p for p, _ in ZEN]},
    "conversational_prompt_only": lambda: {"prompt": [[{"role": "user", "content": q}] for _, q in ZEN]},
}


def referenced_repo_ids(test_file: Path) -> tuple[list[str], list[str]]:
    """(model ids, dataset ids) under trl-internal-testing/ that the test file names."""
    ids = sorted(set(re.findall(r"trl-internal-testing/[A-Za-z0-9_.\-]+", test_file.read_text())))
    datasets_ = [i for i in ids if not i.split("/", 1)[1].startswith("tiny-")]
    return [i for i in ids if i not in datasets_], datasets_


# Qwen2.5/Qwen3's ids for their special tokens: some TRL tests hard-code them (e.g. eos 151645, pad 151643), so
# the Qwen families' tokenizers move these tokens to the same ids (the vocabulary keeps its other ids).
QWEN_SPECIAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657,
                    "</tool_call>": 151658, "<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667,
                    "</think>": 151668}


def _smollm2_tokenizer_with_ids(special_ids: dict[str, int], out_dir: Path):
    """The SmolLM2 tokenizer with the given tokens at the given ids (moved or added), saved to out_dir."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from rollout.runtime.model.fetch import fetch_model

    src = Path(fetch_model(SMOLLM2))
    if not special_ids:
        return AutoTokenizer.from_pretrained(src)
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    added = {a["content"]: a for a in spec["added_tokens"]}
    for content, new_id in special_ids.items():
        vocab.pop(content, None)
        vocab[content] = new_id
        entry = added.get(content) or {"content": content, "single_word": False, "lstrip": False, "rstrip": False,
                                       "normalized": False, "special": True}
        entry["id"] = new_id
        added[content] = entry
    spec["added_tokens"] = sorted(added.values(), key=lambda a: a["id"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_file=str(out_dir / "tokenizer.json"))


def _tokenizer(family: str, scratch: Path):
    import trl

    spec = FAMILIES[family]
    tok = _smollm2_tokenizer_with_ids(QWEN_SPECIAL_IDS if family in ("qwen2_5", "qwen3") else {},
                                      scratch / f"tokenizer-{family}")
    specials = [t for t in [spec["bos"], spec["eos"], spec["pad"], *spec["extra"]] if t]
    missing = [t for t in specials if t not in tok.get_vocab()]
    if missing:
        tok.add_tokens(missing, special_tokens=True)
    tok.bos_token = spec["bos"] or tok.bos_token
    tok.eos_token = spec["eos"]
    tok.pad_token = spec["pad"] or spec["eos"]
    if spec["template"]:
        tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{spec['template']}.jinja").read_text()
    return tok


def build_model(repo_id: str, target: Path) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig

    config_cls, model_cls, kwargs, family = MODEL_RECIPES[repo_id.split("/", 1)[1]]
    tok = _tokenizer(family, target.parent / ".tokenizer-src")
    ids = tok.convert_tokens_to_ids
    gen_eos = [ids(t) for t in FAMILIES[family]["gen_eos"]]
    vocab_size = max(len(tok), max(tok.get_vocab().values()) + 1)  # moved special ids leave holes below them
    config = getattr(transformers, config_cls)(vocab_size=vocab_size, bos_token_id=tok.bos_token_id,
                                               eos_token_id=gen_eos[0] if len(gen_eos) == 1 else gen_eos,
                                               pad_token_id=tok.pad_token_id, **kwargs)
    if getattr(config, "layer_types", None) and len(config.layer_types) != config.num_hidden_layers:
        config.layer_types = config.layer_types[:config.num_hidden_layers]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    for module in model.modules():  # TRL's init_weights_tiny_model: no NaNs from uninitialised weights
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, 0.0, 0.02)
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    if not torch.isfinite(logits).all():
        raise RuntimeError("non-finite logits from the tiny model")
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=gen_eos,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(target)
    tok.save_pretrained(target)


def _hub_cache_dir(hf_home: Path, repo_id: str, kind: str = "models") -> Path:
    return hf_home / "hub" / f"{kind}--{repo_id.replace('/', '--')}"


FAKE_COMMIT = "0" * 40


def build_fixtures(test_file: Path, work: Path, rebuild: bool = False) -> dict:
    """Populate <work>/hf_home (models) and <work>/datasets; return {"models", "datasets", "unbuilt"}."""
    import datasets as hf_datasets

    hf_home = work / "hf_home"
    model_ids, dataset_ids = referenced_repo_ids(test_file)
    built_models, local_datasets, unbuilt = [], {}, {}
    for rid in model_ids:
        name = rid.split("/", 1)[1]
        repo_dir = _hub_cache_dir(hf_home, rid)
        if name not in MODEL_RECIPES:
            unbuilt[rid] = next((why for rx, why in NO_RECIPE_REASONS if rx.search(name)), "no offline recipe")
            continue
        snapshot = repo_dir / "snapshots" / FAKE_COMMIT
        if rebuild or not (snapshot / "config.json").is_file():
            shutil.rmtree(repo_dir, ignore_errors=True)
            try:
                build_model(rid, snapshot)
            except Exception as exc:  # noqa: BLE001 - an unbuildable model is reported, not fatal
                shutil.rmtree(repo_dir, ignore_errors=True)
                unbuilt[rid] = f"build failed: {type(exc).__name__}: {first_line(str(exc))}"
                print(f"[trl_suite] could not build {rid}: {unbuilt[rid]}", flush=True)
                continue
            (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
            (repo_dir / "refs" / "main").write_text(FAKE_COMMIT)
        built_models.append(rid)
    for rid in dataset_ids:
        if rid != "trl-internal-testing/zen":
            unbuilt[rid] = next((why for rx, why in NO_RECIPE_REASONS if rx.search(rid)), "no offline recipe")
            continue
        local_datasets[rid] = {}
        for config, columns in ZEN_CONFIGS.items():
            path = work / "datasets" / rid.replace("/", "--") / config
            if rebuild or not (path / "dataset_dict.json").is_file():
                shutil.rmtree(path, ignore_errors=True)
                ds = hf_datasets.Dataset.from_dict(columns()).train_test_split(test_size=0.1, shuffle=False)
                ds.save_to_disk(str(path))
            local_datasets[rid][config] = str(path)
    return {"models": built_models, "datasets": local_datasets, "unbuilt": unbuilt}


# ------------------------------------------------------------------------------------------------- running
def _env(arm: str, work: Path, fixtures_file: Path, engine_log: Path, timeout_s: int, threads: int) -> dict:
    env = dict(os.environ)
    env.update({
        "HF_HOME": str(work / "hf_home"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(work / "datasets_cache"),
        "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
        # tiny models: intra-op threads only add contention (measured 80 s -> 26 s per test on 2 shared cores)
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "RLSPEC_TRL_ARM": arm, "RLSPEC_TRL_FIXTURES": str(fixtures_file), "RLSPEC_TRL_ENGINE_LOG": str(engine_log),
        "RLSPEC_TRL_TIMEOUT_S": str(timeout_s),
        "PYTHONPATH": os.pathsep.join([str(REPO / "scripts"), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    return env


def _pytest_cmd(tests_dir: Path, junit: Path | None, select: str | None, nodeids: list[str] | None,
                extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", *(nodeids or [str(tests_dir / TEST_FILE)]), "-p", "trl_suite_plugin",
           "-p", "no:cacheprovider", "-q", "-rN", "--tb=line", "-o", "junit_logging=no", f"--rootdir={tests_dir.parent}"]
    if junit is not None:
        cmd.append(f"--junitxml={junit}")
    if select and not nodeids:
        cmd += ["-k", select]
    return cmd + extra


def collect(tests_dir: Path, work: Path, fixtures_file: Path, select: str | None, threads: int) -> list[str]:
    """The selected test nodeids, in file order (pytest --collect-only with the plugin loaded)."""
    cmd = _pytest_cmd(tests_dir, None, select, None, ["--collect-only"])
    env = _env("plain", work, fixtures_file, work / "engine_collect.jsonl", 0, threads)
    out = subprocess.run(cmd, cwd=str(work), env=env, capture_output=True, text=True)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise SystemExit(f"[trl_suite] collection found no tests:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return ids


def run_arms(arms: list[str], tests_dir: Path, work: Path, fixtures_file: Path, select: str | None, timeout_s: int,
             extra_pytest: list[str], jobs: int, threads: int) -> tuple[dict, dict, dict]:
    """Run every arm over the selected tests, split into `jobs` shards per arm, at most `jobs` pytest processes at
    a time (shards of the arms interleaved). Returns ({arm: results}, {arm: engine records}, {arm: wall_s})."""
    nodeids = collect(tests_dir, work, fixtures_file, select, threads)
    shards = [nodeids[i::jobs] for i in range(jobs)] if jobs > 1 else [nodeids]
    tasks = [(arm, i, shard) for i, shard in enumerate(shards) if shard for arm in arms]
    print(f"[trl_suite] {len(nodeids)} tests selected; {len(tasks)} pytest processes ({jobs} at a time)", flush=True)
    for f in work.glob("junit_*.xml"):
        f.unlink()
    for f in work.glob("engine_*.jsonl"):
        f.unlink()
    running: list[tuple] = []
    started: dict[str, float] = {}
    finished: dict[str, float] = {}
    pending = list(tasks)
    while pending or running:
        while pending and len(running) < jobs:
            arm, i, shard = pending.pop(0)
            junit, engine_log = work / f"junit_{arm}_{i}.xml", work / f"engine_{arm}_{i}.jsonl"
            cmd = _pytest_cmd(tests_dir, junit, select, shard if jobs > 1 else None, extra_pytest)
            log = open(work / f"pytest_{arm}_{i}.log", "w")
            print(f"[trl_suite] start {arm} shard {i} ({len(shard)} tests)", flush=True)
            proc = subprocess.Popen(cmd, cwd=str(work), env=_env(arm, work, fixtures_file, engine_log, timeout_s, threads),
                                    stdout=log, stderr=subprocess.STDOUT)
            started.setdefault(arm, time.time())
            running.append((proc, arm, i, log, time.time()))
        time.sleep(2)
        for item in list(running):
            proc, arm, i, log, t0 = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                finished[arm] = time.time()
                print(f"[trl_suite] done {arm} shard {i}: rc={proc.returncode} in {time.time() - t0:.0f}s", flush=True)
    walls = {arm: round(finished.get(arm, time.time()) - started.get(arm, time.time()), 1) for arm in arms}
    results, engines = merge_outputs(arms, work, nodeids)
    return results, engines, walls


def merge_outputs(arms: list[str], work: Path, nodeids: list[str] | None) -> tuple[dict, dict]:
    """Each arm's results and engine records, merged over its shards' JUnit XML and engine logs under `work`."""
    results, engines = {}, {}
    for arm in arms:
        results[arm], engines[arm] = {}, {}
        for junit in sorted(work.glob(f"junit_{arm}_*.xml")):
            results[arm].update(parse_junit(junit.read_text()))
        for log in sorted(work.glob(f"engine_{arm}_*.jsonl")):
            engines[arm].update(parse_engine_log(log.read_text()))
        # a shard that died (crash, OOM) leaves its tests without a JUnit entry: count them as errors
        for nodeid in nodeids or []:
            key = nodeid_key(nodeid)
            if key not in results[arm]:
                results[arm][key] = {"outcome": "error", "message": "no result: the pytest process died", "time_s": 0.0}
        print(f"[trl_suite] {arm}: {counts(results[arm])}", flush=True)
    return results, engines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trl-tests", type=Path, help="a checkout of TRL's tests/ directory for the installed trl version")
    ap.add_argument("--work", type=Path, default=Path("/tmp/rlspec_trl_suite"),
                    help="scratch directory (tiny models, datasets, logs); reused across runs")
    ap.add_argument("--out", type=Path, default=REPO / "bench_out" / "trl_suite.json")
    ap.add_argument("--arms", default="plain,spec", help="comma-separated: plain, spec")
    ap.add_argument("-k", "--select", default=None, help="pytest -k expression: run a subset")
    ap.add_argument("--timeout-s", type=int, default=300, help="per-test limit (0: none)")
    ap.add_argument("--jobs", type=int, default=2,
                    help="pytest processes at a time; each arm's tests are split into this many shards")
    ap.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per pytest process")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the tiny models and datasets")
    ap.add_argument("--note", default="", help="free text recorded in the JSON (e.g. which rlspec tree ran)")
    ap.add_argument("--reuse-results", action="store_true",
                    help="do not run pytest: rebuild --out from the JUnit XML and engine logs left in --work "
                         "(wall times taken from the existing --out)")
    ap.add_argument("--report-only", action="store_true", help="print the summary of an existing --out and exit")
    ap.add_argument("--pytest-arg", action="append", default=[], help="extra argument passed to pytest (repeatable)")
    args = ap.parse_args(argv)

    if args.report_only:
        print(format_summary(json.loads(args.out.read_text())))
        return 0
    if args.trl_tests is None or not (args.trl_tests / TEST_FILE).is_file():
        ap.error(f"--trl-tests must be a TRL tests/ checkout containing {TEST_FILE} (see this script's docstring)")
    import trl

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    tests_dir = work / "trl_tests"  # a copy: TRL's checkout is never written to; "trl_tests" avoids a clash with ours
    shutil.rmtree(tests_dir, ignore_errors=True)
    shutil.copytree(args.trl_tests, tests_dir, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))

    t0 = time.time()
    fixtures = build_fixtures(tests_dir / TEST_FILE, work, rebuild=args.rebuild)
    fixtures_file = work / "fixtures.json"
    fixtures_file.write_text(json.dumps(fixtures, indent=1))
    build_s = time.time() - t0
    print(f"[trl_suite] fixtures in {build_s:.0f}s: {len(fixtures['models'])} models, "
          f"{sum(len(v) for v in fixtures['datasets'].values())} dataset configs, {len(fixtures['unbuilt'])} not built",
          flush=True)

    if args.reuse_results:  # summarise the JUnit XML / engine logs an earlier run left in --work
        results, engines = merge_outputs(arms, work, None)
        previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
        walls = {a: previous.get("wall_s", {}).get(a, 0.0) for a in arms}
        wall_doc = previous.get("wall_s", {})
    else:
        results, engines, walls = run_arms(arms, tests_dir, work, fixtures_file, args.select, args.timeout_s,
                                           args.pytest_arg, args.jobs, args.threads)
    sources = test_sources(tests_dir / TEST_FILE)
    for arm in arms:
        n = reclassify_unbuilt(results[arm], sources, fixtures["unbuilt"])
        print(f"[trl_suite] {arm}: {n} failures needing a model/dataset not built offline counted as skipped", flush=True)
    plain, spec = results.get("plain"), results.get("spec")
    engine = engines.get("spec", {})
    regs = regressions(plain, spec) if plain is not None and spec is not None else []
    doc = {
        "trl_version": trl.__version__,
        "trl_tests_source": str(args.trl_tests.resolve()),
        "trl_tests_version_note": _source_note(args.trl_tests),
        "note": args.note,
        "rlspec_tree": str(REPO),
        "select": args.select,
        "arms": arms,
        "jobs": args.jobs,
        "threads": args.threads,
        "test_time_s": {a: round(sum(r["time_s"] for r in res.values()), 1) for a, res in results.items()},
        "wall_s": wall_doc if args.reuse_results else {**{a: round(w, 1) for a, w in walls.items()},
                                                       "fixtures": round(build_s, 1), "total": round(time.time() - t0, 1)},
        "summary": summarize(plain, spec, engine),
        "regressions": regs,
        "regressions_by_cause": group_by_cause(regs),
        "built_models": fixtures["models"],
        "built_datasets": {k: sorted(v) for k, v in fixtures["datasets"].items()},
        "unbuilt": fixtures["unbuilt"],
        "tests": per_test_table(plain, spec, engine),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(format_summary(doc))
    print(f"\n[trl_suite] wrote {args.out}")
    return 0


def _source_note(tests_dir: Path) -> str:
    """Where the tests came from, when the checkout can tell (git describe / commit)."""
    try:
        top = subprocess.run(["git", "-C", str(tests_dir), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10)
        if top.returncode == 0:
            d = subprocess.run(["git", "-C", str(tests_dir), "describe", "--tags", "--always"], capture_output=True,
                               text=True, timeout=10)
            return f"git {d.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        pass
    marker = tests_dir / "TRL_SOURCE"
    return marker.read_text().strip() if marker.is_file() else "unknown (not a git checkout)"


if __name__ == "__main__":
    sys.exit(main())
