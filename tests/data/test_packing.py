"""Padding-free packing: a packed batch trains exactly as the same documents unpacked, and the Arrow packer."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gym_lightning.data.collate import Collator
from gym_lightning.data.prepare import greedy_row_bounds, pack_dataset
from gym_lightning.loss import IGNORE_INDEX, summed_cross_entropy
from gym_lightning.models.presets import preset_config

DOCS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21], [22, 23, 24, 25]]


def tokenized(docs: list[list[int]]) -> datasets.Dataset:
    features = datasets.Features(
        {"input_ids": datasets.Sequence(datasets.Value("int32")), "labels": datasets.Sequence(datasets.Value("int32"))}
    )
    return datasets.Dataset.from_dict({"input_ids": docs, "labels": docs}, features=features)


def test_arrow_packer_keeps_order_and_marks_document_starts(tmp_path):
    packed = pack_dataset(tokenized(DOCS), 10, tmp_path, rows_per_chunk=2)  # chunks of 2 rows: crosses chunks
    assert greedy_row_bounds(np.array([5, 3, 7, 2, 4]), 10).tolist() == [0, 2, 4, 5]
    assert packed["seq_lens"] == [[5, 3], [7, 2], [4]]
    assert [i for row in packed["input_ids"] for i in row] == [i for doc in DOCS for i in doc]
    starts = [0, 5, 0, 7, 0]
    rows = [0, 0, 1, 1, 2]
    for row, start in zip(rows, starts, strict=True):
        assert packed[row]["labels"][start] == IGNORE_INDEX  # never predicted from the previous document


def test_packed_batch_has_restarting_positions_and_no_attention_mask(tmp_path):
    packed = pack_dataset(tokenized(DOCS), 10, tmp_path)
    batch = Collator(pad_token_id=0)([packed[i] for i in range(len(packed))])
    assert "attention_mask" not in batch
    # Rows of 8, 9 and 4 tokens padded to 9: the padding is one more segment restarting at 0, with no targets.
    assert batch["position_ids"].tolist() == [
        [0, 1, 2, 3, 4, 0, 1, 2, 0],
        [0, 1, 2, 3, 4, 5, 6, 0, 1],
        [0, 1, 2, 3, 0, 1, 2, 3, 4],
    ]
    assert batch["cu_seq_lens"].tolist() == [0, 5, 8, 9, 16, 18, 22, 27]
    assert (batch["labels"][2, 4:] == IGNORE_INDEX).all()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_loss_of_a_packed_batch_equals_the_loss_of_the_documents_unpacked(tmp_path, attn):
    torch.manual_seed(0)
    config = preset_config("tiny-llama")
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config).eval()
    packed = pack_dataset(tokenized(DOCS), 10, tmp_path)
    batch = Collator(pad_token_id=0)([packed[i] for i in range(len(packed))])
    with torch.no_grad():
        # use_cache=False, as the module trains: transformers only derives the document mask without a cache.
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        packed_loss = summed_cross_entropy(logits, batch["labels"])
        # Unpacked: each document alone; its first label masked as packing does.
        alone = sum(
            summed_cross_entropy(model(input_ids=torch.tensor([doc])).logits, torch.tensor([[IGNORE_INDEX, *doc[1:]]]))
            for doc in DOCS
        )
        # Packing without the restarting positions (one position range per row) does differ: the test can fail.
        plain = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
        leaky = summed_cross_entropy(
            model(input_ids=batch["input_ids"], position_ids=plain, use_cache=False).logits, batch["labels"]
        )
    torch.testing.assert_close(packed_loss, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(leaky, alone, rtol=1e-3)
