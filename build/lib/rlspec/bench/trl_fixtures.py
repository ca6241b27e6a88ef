"""The offline fixtures of `python -m rlspec.bench trl-suite`: every `trl-internal-testing/tiny-*` text model the
test file names that has a recipe (TRL's tiny architectures and shapes, random weights, the SmolLM2 tokenizer with
the family's chat template), saved as a Hugging Face hub cache, and the `trl-internal-testing/zen` datasets."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from rlspec.bench.trl_results import first_line

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

    from rlspec.rollout.runtime.model.fetch import fetch_model

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
