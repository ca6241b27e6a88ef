"""`python -m rlspec.bench trl-suite`'s pure logic (JUnit parsing, engine log, summary, regressions: trl_results;
the test file's repo ids: trl_fixtures) on synthetic input: no TRL tests, no network, no models."""
from __future__ import annotations

import json

from rlspec.bench import trl_fixtures, trl_results


def _junit(cases: str) -> str:
    return f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>'


PLAIN = _junit("""
<testcase classname="trl_tests.test_grpo_trainer.TestGRPOTrainer" name="test_a[x]" time="1.5"/>
<testcase classname="trl_tests.test_grpo_trainer.TestGRPOTrainer" name="test_b" time="2"/>
<testcase classname="trl_tests.test_grpo_trainer.TestGRPOTrainer" name="test_c" time="2"/>
<testcase classname="trl_tests.test_grpo_trainer.TestGRPOTrainer" name="test_d" time="0">
  <skipped type="pytest.skip" message="not built offline: trl-internal-testing/tiny-X (vlm)">skip</skipped></testcase>
<testcase classname="trl_tests.test_grpo_trainer" name="test_module_level" time="0.1">
  <failure message="AssertionError: boom&#10;more">trace</failure></testcase>
""")
SPEC = _junit("""
<testcase classname="trl_tests.test_grpo_trainer.TestGRPOTrainer" name="test_a[x]" time="1.5"/>
<testcase classname="trl_tests.test_grpo_trainer.TestGRPOTrainer" name="test_b" time="2">
  <failure message="ValueError: SpecGRPOTrainer's engine does not support ['min_p']">trace</failure></testcase>
<testcase classname="trl_tests.test_grpo_trainer.TestGRPOTrainer" name="test_c" time="2">
  <failure message="">E   NotImplementedError: text only 12
  next line</failure>
  <error message="failed on teardown">trace</error></testcase>
<testcase classname="trl_tests.test_grpo_trainer.TestGRPOTrainer" name="test_d" time="0">
  <skipped type="pytest.skip" message="not built offline: trl-internal-testing/tiny-X (vlm)">skip</skipped></testcase>
<testcase classname="trl_tests.test_grpo_trainer" name="test_module_level" time="0.1"/>
""")
ENGINE = "\n".join(json.dumps(r) for r in [
    {"nodeid": "trl_tests/test_grpo_trainer.py::TestGRPOTrainer::test_a[x]", "constructed": 1, "generations": 3,
     "engine_calls": 3, "engine_samples": 9},
    {"nodeid": "trl_tests/test_grpo_trainer.py::TestGRPOTrainer::test_b", "constructed": 0, "engine_calls": 0},
    {"nodeid": "trl_tests/test_grpo_trainer.py::test_module_level", "constructed": 0, "engine_calls": 0},
])


def test_parse_junit_outcomes_keys_and_messages():
    plain = trl_results.parse_junit(PLAIN)
    assert set(plain) == {"TestGRPOTrainer::test_a[x]", "TestGRPOTrainer::test_b", "TestGRPOTrainer::test_c",
                          "TestGRPOTrainer::test_d", "test_module_level"}
    assert plain["TestGRPOTrainer::test_a[x]"] == {"outcome": "passed", "message": "", "time_s": 1.5}
    assert plain["TestGRPOTrainer::test_d"]["outcome"] == "skipped"
    assert plain["test_module_level"] == {"outcome": "failed", "message": "AssertionError: boom", "time_s": 0.1}
    spec = trl_results.parse_junit(SPEC)
    # a failure plus a teardown error is a failure; the first line comes from the text when the message is empty
    assert spec["TestGRPOTrainer::test_c"]["outcome"] == "failed"
    assert spec["TestGRPOTrainer::test_c"]["message"] == "E   NotImplementedError: text only 12"


def test_engine_log_keys_match_junit_keys():
    engine = trl_results.parse_engine_log(ENGINE)
    assert engine["TestGRPOTrainer::test_a[x]"]["engine_calls"] == 3
    assert engine["test_module_level"]["engine_calls"] == 0
    assert set(engine) <= set(trl_results.parse_junit(SPEC))


def test_summary_and_regressions():
    plain, spec = trl_results.parse_junit(PLAIN), trl_results.parse_junit(SPEC)
    engine = trl_results.parse_engine_log(ENGINE)
    s = trl_results.summarize(plain, spec, engine)
    assert s["plain"] == {"total": 5, "passed": 3, "failed": 1, "error": 0, "skipped": 1}
    assert s["spec"] == {"total": 5, "passed": 2, "failed": 2, "error": 0, "skipped": 1}
    assert s["spec_passing_sampled_through_engine"] == 1  # test_a sampled; test_module_level passed without
    assert s["pass_on_plain_fail_on_spec"] == 2
    assert s["fixed_on_spec"] == 1
    assert s["spec_passing_generated"] == 1
    assert s["engine_bar"] == 68  # GRPO's fixed bar is above two thirds of one generating test
    assert s["bar_met"] is False
    regs = trl_results.regressions(plain, spec)
    assert [r["test"] for r in regs] == ["TestGRPOTrainer::test_b", "TestGRPOTrainer::test_c"]
    assert regs[0]["error"].startswith("ValueError: SpecGRPOTrainer's engine does not support")
    groups = trl_results.group_by_cause(regs)
    assert sum(len(v) for v in groups.values()) == 2
    assert "E   NotImplementedError: text only N" in groups  # numbers blurred so parameters group together


def test_missing_spec_result_is_a_regression_and_table_renders():
    plain = trl_results.parse_junit(PLAIN)
    spec = {k: v for k, v in trl_results.parse_junit(PLAIN).items() if k != "TestGRPOTrainer::test_b"}
    regs = trl_results.regressions(plain, spec)
    assert regs == [{"test": "TestGRPOTrainer::test_b", "spec_outcome": "missing", "error": "not run on spec"}]
    doc = {"summary": trl_results.summarize(plain, spec, {}), "wall_s": {"plain": 1, "spec": 2},
           "regressions_by_cause": trl_results.group_by_cause(regs), "unbuilt": {"a/b": "why"}}
    text = trl_results.format_summary(doc)
    assert "plain" in text and "spec" in text and "a/b: why" in text


def test_referenced_repo_ids_splits_models_and_datasets(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text('m = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"\n'
                 'd = load_dataset("trl-internal-testing/zen", "standard_prompt_only")\n'
                 'i = "trl-internal-testing/zen-image"\n')
    models, datasets = trl_fixtures.referenced_repo_ids(f)
    assert models == ["trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"]
    assert datasets == ["trl-internal-testing/zen", "trl-internal-testing/zen-image"]


def test_unbuilt_failures_become_skips_in_both_arms(tmp_path):
    f = tmp_path / "test_grpo_trainer.py"
    f.write_text('class TestGRPOTrainer:\n'
                 '    def test_remote(self):\n'
                 '        m = "trl-internal-testing/tiny-RemoteForCausalLM"\n'
                 '    @pytest.mark.parametrize("model_id", ["trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"])\n'
                 '    def test_param(self, model_id):\n'
                 '        pass\n')
    sources = trl_results.test_sources(f)
    assert set(sources) == {"TestGRPOTrainer::test_remote", "TestGRPOTrainer::test_param"}
    unbuilt = {"trl-internal-testing/tiny-RemoteForCausalLM": "remote code",
               "trl-internal-testing/tiny-Qwen2VLForConditionalGeneration": "vlm"}
    offline = "OSError: We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them"
    results = {
        "TestGRPOTrainer::test_remote": {"outcome": "failed", "message": offline, "time_s": 1},
        "TestGRPOTrainer::test_param[trl-internal-testing/tiny-Qwen2VLForConditionalGeneration]":
            {"outcome": "failed", "message": offline, "time_s": 1},
        "TestGRPOTrainer::test_param[trl-internal-testing/tiny-Qwen2ForCausalLM-2.5]":
            {"outcome": "failed", "message": offline, "time_s": 1},  # built: a real failure, kept
        "TestGRPOTrainer::test_other": {"outcome": "failed", "message": "AssertionError", "time_s": 1},
    }
    assert trl_results.reclassify_unbuilt(results, sources, unbuilt) == 2
    assert results["TestGRPOTrainer::test_remote"]["outcome"] == "skipped"
    assert "tiny-RemoteForCausalLM" in results["TestGRPOTrainer::test_remote"]["message"]
    assert results["TestGRPOTrainer::test_param[trl-internal-testing/tiny-Qwen2VLForConditionalGeneration]"][
        "outcome"] == "skipped"
    assert results["TestGRPOTrainer::test_param[trl-internal-testing/tiny-Qwen2ForCausalLM-2.5]"]["outcome"] == "failed"
    assert results["TestGRPOTrainer::test_other"]["outcome"] == "failed"


def test_engine_bar_is_two_thirds_of_the_generating_passes():
    assert trl_results.engine_bar(30, "rloo") == 20
    assert trl_results.engine_bar(31, "rloo") == 21  # rounded up: two thirds at least
    assert trl_results.engine_bar(0, "rloo") == 0
    assert trl_results.engine_bar(120, "grpo") == 80 and trl_results.engine_bar(90, "grpo") == 68


def test_rloo_bar_met_and_one_line():
    rloo = _junit("""
<testcase classname="trl_tests.test_rloo_trainer.TestRLOOTrainer" name="test_gen_engine" time="1"/>
<testcase classname="trl_tests.test_rloo_trainer.TestRLOOTrainer" name="test_gen_beams" time="1"/>
<testcase classname="trl_tests.test_rloo_trainer.TestRLOOTrainer" name="test_gen_engine_2" time="1"/>
<testcase classname="trl_tests.test_rloo_trainer.TestRLOOTrainer" name="test_init_only" time="1"/>
""")
    results = trl_results.parse_junit(rloo)
    log = "\n".join(json.dumps({"nodeid": f"trl_tests/test_rloo_trainer.py::TestRLOOTrainer::{name}",
                                 "generations": gens, "engine_calls": calls})
                    for name, gens, calls in [("test_gen_engine", 2, 2), ("test_gen_beams", 2, 0),
                                              ("test_gen_engine_2", 1, 1), ("test_init_only", 0, 0)])
    engine = trl_results.parse_engine_log(log)
    s = trl_results.summarize(results, results, engine, "rloo")
    assert (s["spec_passing_generated"], s["spec_passing_sampled_through_engine"], s["engine_bar"]) == (3, 2, 2)
    assert s["bar_met"] is True
    line = trl_results.one_line({"trainer": "rloo", "summary": s})
    assert line == ("trl-suite rloo: plain 4/4 passed, spec 4/4; 0 pass on plain only; 2 of 3 generating passes "
                    "sampled through the engine (bar 2): MET")
    engine["TestRLOOTrainer::test_gen_engine_2"]["engine_calls"] = 0  # one fewer through the engine: 1 < 2
    assert trl_results.summarize(results, results, engine, "rloo")["bar_met"] is False
