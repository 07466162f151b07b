"""A checkpoint written by `dpserve finetune` is what vLLM serves: a real replica
started on it generates, greedily, exactly the tokens transformers generates —
for a full fine-tune, and for a LoRA adapter folded into full weights by
`dpserve export-merged` (compared with transformers + peft running the adapter
unmerged)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dpserve import checkpoint as ckpt
from tests.finetune_helpers import reference_greedy, trained, write_train_data
from tests.integration.conftest import MODEL_NAME, start_deployment

pytestmark = pytest.mark.vllm

PROMPTS = ["Write about the river (1):", "Tell me about rain.", "The baker"]
NEW_TOKENS = 12


def served_greedy(checkpoint: Path, workdir: Path, expected: dict[str, object]) -> None:
    """Start a replica on `checkpoint`; for every prompt, vLLM's greedy tokens must equal
    `expected[prompt](token_ids)`."""
    d = start_deployment(checkpoint, workdir, replicas=1)
    try:
        with httpx.Client(base_url=d.base_url, timeout=60) as h:
            for prompt in PROMPTS:
                ids = h.post("/tokenize", json={"model": MODEL_NAME, "prompt": prompt}).json()
                r = h.post("/v1/completions", json={
                    "model": MODEL_NAME, "prompt": ids["tokens"], "max_tokens": NEW_TOKENS,
                    "temperature": 0, "return_token_ids": True, "logprobs": 1})
                choice = r.json()["choices"][0]
                reference = expected[prompt]
                assert callable(reference)
                assert choice["token_ids"] == reference(ids["tokens"]), prompt
                assert all(lp is not None and lp > -1e9 for lp in
                           choice["logprobs"]["token_logprobs"])
    finally:
        d.stop()


def test_a_finetuned_checkpoint_is_served_by_vllm_as_transformers_runs_it(tiny_model,
                                                                          tmp_path):
    data = write_train_data(tmp_path / "train.jsonl")
    checkpoint = trained(tiny_model, data, tmp_path / "out", nproc=2, micro_batch_size=4,
                         max_steps=10)
    served_greedy(checkpoint, tmp_path / "serve", {
        p: (lambda ids: reference_greedy(checkpoint, ids, NEW_TOKENS)) for p in PROMPTS})


def test_a_merged_lora_adapter_is_served_by_vllm_as_peft_runs_the_adapter(tiny_model,
                                                                          tmp_path):
    data = write_train_data(tmp_path / "train.jsonl")
    adapter = trained(tiny_model, data, tmp_path / "out", nproc=2, micro_batch_size=4,
                      max_steps=10, lora_rank=8, lr=2e-2)
    assert ckpt.read_meta(adapter).extra["kind"] == "lora"
    done = subprocess.run([sys.executable, "-m", "dpserve", "export-merged", str(adapter),
                           str(tmp_path / "merged")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    merged = Path(done.stdout.strip().splitlines()[-1])
    assert ckpt.verify_checkpoint(merged).extra["kind"] == "full"
    # The adapter changes what the model says, so equal tokens mean it was applied.
    changed = False

    def with_adapter(ids: list[int]) -> list[int]:
        nonlocal changed
        tokens = reference_greedy(tiny_model, ids, NEW_TOKENS, adapter=adapter)
        changed |= tokens != reference_greedy(tiny_model, ids, NEW_TOKENS)
        return tokens

    served_greedy(merged, tmp_path / "serve", dict.fromkeys(PROMPTS, with_adapter))
    assert changed, "the adapter changed no greedy token: the comparison shows nothing"
