"""rlspec's benchmarks, one module per `python -m rlspec.bench <name>` (the registry: __main__.py; the shared
harness: harness.py). docs/benchmarks.md lists what each measures, its command and its latest figure."""
