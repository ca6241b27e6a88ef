"""`python -m rlspec.bench <name> [flags]`: one command for every benchmark, as `vllm bench`.

Each benchmark is a module of this package exposing NAME, HELP (one line), add_arguments(parser) and
run(args) -> dict (the JSON report); the harness adds --smoke, --out, --reps and --seed, writes the JSON
(dated by day and commit) and the PNG, and prints the table. The registry below names the module of each
benchmark; nothing is imported until one is chosen, and the listing reads each module's HELP from its source,
so `--help` is fast and torch loads only for the benchmark that runs. docs/benchmarks.md: what each measures,
its command and its latest figure.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import sys

from rlspec.bench import harness

REGISTRY = {
    "rollout": "rlspec.bench.rollout",
    "step": "rlspec.bench.step",
    "linear": "rlspec.bench.linear",
    "drafter": "rlspec.bench.drafter",
    "grpo": "rlspec.bench.grpo",
    "ppo": "rlspec.bench.ppo",
    "dropin": "rlspec.bench.dropin",
    "partial": "rlspec.bench.partial",
    "partial-weights": "rlspec.bench.partial_weights",
    "passes": "rlspec.bench.passes",
    "kv": "rlspec.bench.kv",
    "lossy": "rlspec.bench.lossy",
    "vllm": "rlspec.bench.vllm",
    "workers": "rlspec.bench.workers",
    "chaos": "rlspec.bench.chaos",
    "trl-suite": "rlspec.bench.trl_suite",
    "gpu": "rlspec.bench.gpu",
    "kernel-checks": "rlspec.bench.kernel_checks",
    "host": "rlspec.bench.host",
    "kernels": "rlspec.bench.kernels",
    "ahead": "rlspec.bench.ahead",
}


class MissingBenchmark(SystemExit):
    """The registry names a module that is not there."""


def help_line(module: str) -> str:
    """The module's HELP, read from its source without importing it (or why there is none)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return "(benchmark module missing)"
    tree = ast.parse(open(spec.origin).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "HELP" for t in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                break
    return "(no HELP line)"


def load(name: str):
    """The benchmark module `name`, imported now; a clear exit when it is unknown or missing."""
    if name not in REGISTRY:
        raise MissingBenchmark(f"unknown benchmark {name!r}; choose one of: {', '.join(REGISTRY)}")
    path = REGISTRY[name]
    if importlib.util.find_spec(path) is None:
        raise MissingBenchmark(f"the benchmark {name!r} is registered but its module {path} is missing "
                               f"(rlspec/bench/{path.rsplit('.', 1)[1]}.py): restore the file or drop it from "
                               "REGISTRY in rlspec/bench/__main__.py")
    module = importlib.import_module(path)
    for attr in ("NAME", "HELP", "add_arguments", "run"):
        if not hasattr(module, attr):
            raise MissingBenchmark(f"{path} does not define {attr}: every benchmark module exposes NAME, HELP, "
                                   "add_arguments(parser) and run(args) -> dict")
    return module


def listing() -> str:
    width = max(map(len, REGISTRY))
    return "\n".join(f"  {name:<{width}}  {help_line(mod)}" for name, mod in REGISTRY.items())


def top_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="python -m rlspec.bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python -m rlspec.bench <name> [flags]   (python -m rlspec.bench <name> --help for its flags)",
        description=__doc__.split("\n\n")[0], epilog="benchmarks:\n" + listing())


def bench_parser(module) -> argparse.ArgumentParser:
    """The parser of one benchmark: its own flags, then the harness's common ones it did not define."""
    doc = (module.__doc__ or module.HELP).strip()
    parser = argparse.ArgumentParser(prog=f"python -m rlspec.bench {module.NAME}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    harness.add_common_flags(parser, module.NAME)
    return parser


def main(argv: list[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        top_parser().print_help()
        return None
    name, rest = argv[0], argv[1:]
    module = load(name)
    args = bench_parser(module).parse_args(rest)
    args.out = harness.default_out(args, module.NAME)
    report = module.run(args)
    return harness.finish(module, args, report, rest)


if __name__ == "__main__":
    try:
        result = main()
    except MissingBenchmark as exc:
        print(f"rlspec.bench: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(1 if result is not None and result.get("ok") is False else 0)  # a benchmark that checks (chaos) failed
