"""The on-disk checkpoint format shared by `dpserve finetune` (writer) and the
rolling deploy (reader, validator).

Layout of a fine-tune output directory::

    OUTPUT/step-000120/              what vLLM loads: HF layout (config, safetensors, tokenizer)
    OUTPUT/step-000120/dpserve.json  written last: step, base model, sha256 of every file, ...
    OUTPUT/train-state/step-000120/  optimizer, scheduler, RNG for --resume; `complete` last
    OUTPUT/.step-000120.tmp-XXXX/    a save in progress (or one killed midway)

`format` says what a checkpoint is and reads one defensively (names, `dpserve.json`,
listing, verification); `writer` publishes and prunes them, so that nothing that
looks complete is ever half-written. Both are re-exported here: callers write
`from dpserve import checkpoint as ckpt` and `ckpt.read_meta`, `ckpt.write_checkpoint`.

Errors: `CheckpointError` for a directory that is not a valid checkpoint or
cannot be written as one (the message names the path and the problem);
`ValueError` for arguments that could never be right (a negative step).
"""

from dpserve.checkpoint.format import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    FORMAT_VERSION,
    MAX_META_BYTES,
    META_FILE,
    STATE_DIR,
    STATE_MARKER,
    CheckpointError,
    CheckpointMeta,
    base_fingerprint,
    checkpoint_kind,
    fingerprint_of,
    latest_checkpoint,
    list_checkpoints,
    open_regular,
    parse_meta,
    read_capped,
    read_meta,
    read_meta_bytes,
    sha256_file,
    step_name,
    train_state_dir,
    verify_checkpoint,
)
from dpserve.checkpoint.writer import prune_checkpoints, write_checkpoint, write_train_state

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "FORMAT_VERSION",
    "MAX_META_BYTES",
    "META_FILE",
    "STATE_DIR",
    "STATE_MARKER",
    "CheckpointError",
    "CheckpointMeta",
    "base_fingerprint",
    "checkpoint_kind",
    "fingerprint_of",
    "latest_checkpoint",
    "list_checkpoints",
    "open_regular",
    "parse_meta",
    "prune_checkpoints",
    "read_capped",
    "read_meta",
    "read_meta_bytes",
    "sha256_file",
    "step_name",
    "train_state_dir",
    "verify_checkpoint",
    "write_checkpoint",
    "write_train_state",
]
