"""The benchmark harness runs from an installed wheel as from a checkout: reports under the working directory,
git optional (a tree that is no checkout's root says "unknown"), one helper for runs in child processes."""
import argparse
import json
import subprocess

from rlspec.bench import harness


def test_changed_figures_leave_the_tree_clean_changed_code_does_not(tmp_path, monkeypatch):
    def git(*cmd):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *cmd], check=True,
                       capture_output=True)

    (tmp_path / "bench_out").mkdir()
    (tmp_path / "bench_out" / "x.json").write_text("1")
    (tmp_path / "code.py").write_text("a = 1")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "c")
    monkeypatch.setattr(harness, "ROOT", tmp_path.resolve())
    assert harness.source_state()["dirty"] is False
    (tmp_path / "bench_out" / "x.json").write_text("2")  # a benchmark rewrote its figure
    assert harness.source_state()["dirty"] is False
    (tmp_path / "code.py").write_text("a = 2")
    assert harness.source_state()["dirty"] is True


def test_reports_go_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(out=None, smoke=False)
    assert harness.default_out(args, "kv-memory") == str(tmp_path / "bench_out" / "kv_memory.json")
    assert harness.default_out(argparse.Namespace(out="x.json"), "kv") == "x.json"


def test_the_commit_is_the_source_trees_or_unknown(tmp_path, monkeypatch):
    here = harness.source_state()
    head = subprocess.run(["git", "-C", str(harness.ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert here["commit"] == head and isinstance(here["dirty"], bool)
    monkeypatch.setattr(harness, "ROOT", tmp_path)  # a wheel's site-packages: no checkout
    assert harness.source_state() == {"commit": "unknown", "dirty": None}
    monkeypatch.setattr(harness, "ROOT", harness.Path(__file__).resolve().parent)  # inside a checkout, not its root
    assert harness.source_state()["commit"] == "unknown"
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    monkeypatch.setattr(harness, "ROOT", tmp_path)
    assert harness.source_state()["commit"] == "unknown"
    assert harness.provenance("x", [])["commit"] == "unknown"


def test_a_child_run_prints_its_result_for_the_parent(capsys):
    runs = harness.ChildRuns("drop-in")
    parser = argparse.ArgumentParser()
    runs.add_flag(parser)
    assert runs.serve(parser.parse_args([]), lambda spec: 1 / 0) is None  # the parent: nothing served
    got = runs.serve(parser.parse_args(["--child", json.dumps({"arm": "a", "n": 2})]),
                     lambda spec: {"arm": spec["arm"], "total": spec["n"] * 3})
    assert got == {"arm": "a", "total": 6, "no_plot": True}
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == "DROP_IN_RESULT " + json.dumps({"arm": "a", "total": 6})


def test_children_import_rlspec_from_where_the_parent_did(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = harness.child_env({"X": "1"}, path=["/carried"])
    assert env["PYTHONPATH"].split(":") == ["/carried", str(harness.ROOT), "/elsewhere"] and env["X"] == "1"
