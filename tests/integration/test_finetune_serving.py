"""A checkpoint written by `dpserve finetune` is what vLLM serves: a real replica
started on it generates, greedily, exactly the tokens transformers generates."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.finetune_helpers import trained, write_train_data
from tests.integration.conftest import MODEL_NAME, start_deployment

pytestmark = pytest.mark.vllm

PROMPTS = ["Write about the river (1):", "Tell me about rain.", "The baker"]
NEW_TOKENS = 12


def transformers_greedy(ckpt_dir, prompt_ids: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS,
                             do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_a_finetuned_checkpoint_is_served_by_vllm_as_transformers_runs_it(tiny_model,
                                                                          tmp_path):
    data = write_train_data(tmp_path / "train.jsonl")
    checkpoint = trained(tiny_model, data, tmp_path / "out", nproc=2, micro_batch_size=4,
                         max_steps=10)
    d = start_deployment(checkpoint, tmp_path / "serve", replicas=1)
    try:
        with httpx.Client(base_url=d.base_url, timeout=60) as h:
            for prompt in PROMPTS:
                ids = h.post("/tokenize", json={"model": MODEL_NAME, "prompt": prompt}).json()
                r = h.post("/v1/completions", json={
                    "model": MODEL_NAME, "prompt": ids["tokens"], "max_tokens": NEW_TOKENS,
                    "temperature": 0, "return_token_ids": True, "logprobs": 1})
                choice = r.json()["choices"][0]
                expected = transformers_greedy(checkpoint, ids["tokens"])
                assert choice["token_ids"] == expected, prompt
                assert all(lp is not None and lp > -1e9 for lp in
                           choice["logprobs"]["token_logprobs"])
    finally:
        d.stop()
