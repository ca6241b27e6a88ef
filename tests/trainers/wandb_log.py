"""Read the history of an offline W&B run back from its `run-*.wandb` file (tests only).

wandb 0.31 has no Python reader for offline runs (the writer is its Go core), so this parses the
file's LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of records,
each with a 7-byte header (crc32, length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4) and a protobuf Record.
"""
from __future__ import annotations

import glob
import json
import os
import struct
import time

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: str):
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (header {data[:7]!r})")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if room >= 7 else (0, 0, 0)
        if room < 7 or (length == 0 and kind == 0):  # block trailer padding
            pos += room
            continue
        if pos + 7 + length > len(data):
            return  # a record still being written
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def offline_run_files(wandb_dir: str) -> list[str]:
    """The run files of every offline run under WANDB_DIR."""
    return sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb")))


def wait_for_exit_record(run_file: str, timeout_s: float = 60.0) -> None:
    """wandb.finish() can return before wandb-core has flushed the file: wait for the run's exit record."""
    deadline = time.monotonic() + timeout_s
    while not any(r.WhichOneof("record_type") == "exit" for r in _records(run_file)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run_file} has no exit record after {timeout_s} s: the run was not finished")
        time.sleep(0.2)


def read_history(run_file: str, timeout_s: float = 60.0) -> list[dict]:
    """One dict per logged history row, keys as logged (e.g. "train/reward"), once the run is flushed."""
    wait_for_exit_record(run_file, timeout_s)
    rows = []
    for record in _records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                         for item in record.history.item})
    return rows
