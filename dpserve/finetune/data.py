"""Training data: JSONL in, token ids and loss labels out.

One example per line (blank lines are skipped, unknown keys ignored), either

    {"prompt": "...", "completion": "..."}          loss on the completion and an eos
    {"messages": [{"role": ..., "content": ...}]}   chat template; loss on assistant turns

Every line is validated before anything is tokenized, so a malformed line
anywhere stops the run before training starts, with a `FILE:LINE:` message.

Tokens are made the way vLLM makes them when serving, so the model learns
exactly what it will be asked to continue:

- prompt/completion: the prompt is encoded like a completions request (the
  tokenizer's own bos, if it adds one; never an eos), the completion is
  encoded on its own (as the model would generate it), then eos is appended.
- messages: the chat template is rendered to text and encoded without special
  tokens (the template writes bos itself), as vLLM's chat endpoint does.

Labels follow the Hugging Face causal-LM convention: `labels[i] == input_ids[i]`
where position i is learned, `IGNORE_INDEX` elsewhere; the loss shifts them.
`labels[0]` is always `IGNORE_INDEX` since no token predicts the first one, so
counting non-ignored labels counts the tokens the loss is taken over.

`load_rank_data` splits the examples over the ranks (a shuffled DistributedSampler;
the eval set exactly once over all of them) and derives the run's length in steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from dpserve.finetune.config import FinetuneConfig
from dpserve.finetune.dist import Dist
from dpserve.records import DataError as DataError
from dpserve.records import read_records as _read_records

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
"""Label of a position without loss (cross-entropy's default `ignore_index`)."""



@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]
    """Same length as `input_ids`; `IGNORE_INDEX` where there is no loss."""

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise ValueError(f"{len(self.input_ids)} input ids but {len(self.labels)} labels")


@dataclass(frozen=True)
class DataStats:
    examples: int
    """Examples kept (each has at least one learned token)."""
    skipped_empty: int
    """Examples dropped because truncation to max_seq_len cut all their learned tokens."""
    truncated: int
    """Kept examples that were cut to max_seq_len."""
    tokens: int
    """Tokens in the kept examples."""
    loss_tokens: int
    """Learned tokens in the kept examples: what the loss is averaged over."""


def load_dataset(
    path: Path, tokenizer: PreTrainedTokenizerBase, *, max_seq_len: int
) -> tuple[list[Example], DataStats]:
    """Validate every line of `path`, then tokenize each example, truncated to `max_seq_len`.

    Raises `DataError` for a missing, unreadable or empty file, for the first
    malformed line, for a conversation the chat template cannot split into
    turns, and when no example has a learned token left after truncation.
    """
    records = _read_records(path)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(f"{path}: the tokenizer has no eos token, so no example could learn "
                        "to stop")
    bos = _bos_added_by(tokenizer)
    examples: list[Example] = []
    skipped = truncated = 0
    for line, record in records:
        where = f"{path}:{line}"
        if "messages" in record:
            ex = _encode_chat(record["messages"], tokenizer, where)
        else:
            prompt = bos + _encode(tokenizer, record["prompt"])
            completion = [*_encode(tokenizer, record["completion"]), eos]
            ex = _completion_example(prompt, completion)
        if len(ex.input_ids) > max_seq_len:
            ex = Example(ex.input_ids[:max_seq_len], ex.labels[:max_seq_len])
            if not _learned(ex):
                skipped += 1
                continue
            truncated += 1
        examples.append(ex)
    if not examples:
        raise DataError(f"{path}: no example keeps a learned token within max_seq_len "
                        f"{max_seq_len}")
    stats = DataStats(
        examples=len(examples),
        skipped_empty=skipped,
        truncated=truncated,
        tokens=sum(len(ex.input_ids) for ex in examples),
        loss_tokens=sum(_learned(ex) for ex in examples),
    )
    return examples, stats


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: `input_ids` with `pad_id`, `labels` with
    `IGNORE_INDEX`, `attention_mask` 1 on tokens and 0 on padding (all int64)."""
    if not examples:
        raise ValueError("collate needs at least one example")
    shape = (len(examples), max(len(ex.input_ids) for ex in examples))
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    for row, ex in enumerate(examples):
        n = len(ex.input_ids)
        input_ids[row, :n] = torch.tensor(ex.input_ids, dtype=torch.long)
        labels[row, :n] = torch.tensor(ex.labels, dtype=torch.long)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class ExampleDataset(Dataset[Example]):
    """A list of examples as a map-style dataset, for `DistributedSampler`."""

    def __init__(self, examples: list[Example]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Example:
        return self.examples[index]


def _encode_chat(
    messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, where: str
) -> Example:
    """Render the conversation turn by turn; learn only what the assistant says.

    An assistant turn is the token difference between the conversation rendered
    up to it with the generation prompt (what vLLM would send the model) and
    rendered through it. It is learned through its last eos (the end of turn);
    template filler after that, such as a newline, is not. Each rendering must
    be a token prefix of the next, which is checked. Messages after the last
    assistant turn teach nothing and are dropped.
    """
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    labels: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], where, generation_prompt=True)
        turn = _render(tokenizer, messages[: i + 1], where, generation_prompt=False)
        if prompt[: len(ids)] != ids or turn[: len(prompt)] != prompt:
            raise DataError(
                f"{where}: the chat template is not prefix-stable at messages[{i}] (rendering "
                "the conversation up to a turn is not a prefix of rendering it through that "
                "turn), so the assistant's tokens cannot be told apart")
        reply = turn[len(prompt):]
        end = len(reply) - reply[::-1].index(eos) if eos in reply else len(reply)
        labels += [IGNORE_INDEX] * (len(prompt) - len(ids))
        labels += reply[:end] + [IGNORE_INDEX] * (len(reply) - end)
        ids = turn
    return Example(ids, [IGNORE_INDEX, *labels[1:]])


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    where: str,
    *,
    generation_prompt: bool,
) -> list[int]:
    if tokenizer.chat_template is None:
        raise DataError(f"{where}: a \"messages\" example needs a chat template, and the "
                        "tokenizer has none")
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # the template is the model's code: any failure is a refusal
        raise DataError(f"{where}: the chat template rejected this conversation: {exc}") from exc
    return _encode(tokenizer, str(text))


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _bos_added_by(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """`[bos]` if the tokenizer puts bos before encoded text (as for a completions
    prompt), else `[]`. Asked of the tokenizer, since its `add_bos_token` flag
    is not always what its post-processor does."""
    bos = tokenizer.bos_token_id
    adds = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    return [bos] if adds else []


def _completion_example(prompt: list[int], completion: list[int]) -> Example:
    labels = [IGNORE_INDEX] * len(prompt) + completion
    return Example(prompt + completion, [IGNORE_INDEX, *labels[1:]])


def _learned(ex: Example) -> int:
    return sum(label != IGNORE_INDEX for label in ex.labels)


# -- split over the ranks ------------------------------------------------------------


@dataclass
class RankData:
    """The training set split over ranks, and what its size implies."""

    dataset: ExampleDataset
    sampler: DistributedSampler[Any]
    loader: DataLoader[Any]
    eval_loader: DataLoader[Any] | None
    stats: DataStats
    batches_per_epoch: int
    steps_per_epoch: int
    max_steps: int


def load_rank_data(cfg: FinetuneConfig, d: Dist, tokenizer: Any) -> RankData:
    """The training set (and the eval set) as rank `d.rank` reads it, and the run's
    length in steps; DataError if the data make no full step."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        tokenizer.eos_token_id)
    examples, stats = load_dataset(Path(cfg.data), tokenizer, max_seq_len=cfg.max_seq_len)
    dataset = ExampleDataset(examples)
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=d.world_size, rank=d.rank, shuffle=True, seed=cfg.seed,
        drop_last=True)
    collate_fn = partial(collate, pad_id=pad_id)
    loader = DataLoader(dataset, batch_size=cfg.micro_batch_size, sampler=sampler,
                        collate_fn=collate_fn, drop_last=True)
    batches_per_epoch = len(loader)
    steps_per_epoch = batches_per_epoch // cfg.grad_accum
    if steps_per_epoch == 0:
        raise DataError(
            f"{cfg.data}: {len(dataset)} usable examples make no full step of "
            f"{cfg.micro_batch_size * d.world_size * cfg.grad_accum} (micro-batch x world "
            f"size x accumulation); add data or lower the batch")
    max_steps = cfg.max_steps or max(1, math.ceil((cfg.epochs or 1.0) * steps_per_epoch))
    eval_loader = None
    if cfg.eval_data is not None:
        eval_examples, _ = load_dataset(Path(cfg.eval_data), tokenizer,
                                        max_seq_len=cfg.max_seq_len)
        # Every example exactly once over all ranks (a DistributedSampler would pad
        # with repeats); ranks may get unequal counts, only the final sums are reduced.
        eval_set = Subset(ExampleDataset(eval_examples),
                          range(d.rank, len(eval_examples), d.world_size))
        eval_loader = DataLoader(eval_set, batch_size=cfg.micro_batch_size,
                                 collate_fn=collate_fn)
    return RankData(dataset, sampler, loader, eval_loader, stats, batches_per_epoch,
                    steps_per_epoch, max_steps)
