"""Reads an offline wandb run back: the records of its `.wandb` transaction log, decoded with
wandb's own protobuf schema (`wandb.proto.wandb_internal_pb2.Record`).

The file is a W&B header (`:W&B`, 2-byte ident, 1-byte version) followed by LevelDB-log framing:
32 KiB blocks of chunks, each with a 7-byte header (crc32c, little-endian length, type).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    pos, parts = 7, []
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        payload = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind == FULL:
            parts = [payload]
        elif kind == FIRST:
            parts = [payload]
            continue
        elif kind == MIDDLE:
            parts.append(payload)
            continue
        elif kind == LAST:
            parts.append(payload)
        else:
            break  # zeros past the end of a file that was cut short
        record = pb.Record()
        record.ParseFromString(b"".join(parts))
        yield record


def _items(items) -> dict:
    return {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items}


def read_run(run_file: str | Path) -> dict:
    """The run record, config, history rows, summary, metric definitions, files and exit code."""
    out = dict(run=None, config={}, history=[], summary={}, metrics=[], files=[], exit_code=None)
    for record in records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run"] = record.run
            out["config"].update(_items(record.run.config.update))
        elif kind == "config":
            out["config"].update(_items(record.config.update))
        elif kind == "history":
            out["history"].append(_items(record.history.item))
        elif kind == "summary":
            out["summary"].update(_items(record.summary.update))
        elif kind == "metric":
            out["metrics"].append(record.metric)
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
        elif kind == "files":
            out["files"].extend(f.path for f in record.files.files)
    return out


def offline_runs(run_dir: str | Path) -> list:
    """The run dir's offline wandb runs, oldest first, each read back with read_run."""
    files = sorted(Path(run_dir, "wandb").glob("offline-run-*/run-*.wandb"))
    return [read_run(path) for path in files]
