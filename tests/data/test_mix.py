"""``data.mix``: how several training sources become one (LLaMA-Factory's ``mix_strategy`` names).

``interleave_over`` (the default, unchanged) repeats a smaller set until every set is drawn completely; ``concat``
(LLaMA-Factory's default) takes each record once; ``interleave_under`` stops at the first set that runs out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gym_lightning.data.datamodule import CausalLMDataModule
from gym_lightning.data.prepare import DataSource
from gym_lightning.errors import GymUserError


def _texts(path: Path, prefix: str, count: int) -> str:
    path.write_text("".join(json.dumps({"text": f"{prefix} {i}"}) + "\n" for i in range(count)))
    return str(path)


def _decoded(tmp_path: Path, mix: str) -> list[str]:
    small, large = _texts(tmp_path / "small.jsonl", "small", 4), _texts(tmp_path / "large.jsonl", "large", 12)
    data = CausalLMDataModule(
        sources=[DataSource(small), DataSource(large)], mix=mix, cache_dir=str(tmp_path / "cache"), seed=1
    )
    rows = data.train_dataloader().dataset["input_ids"]
    return [data.tokenizer.decode(ids).split()[0] for ids in rows]


def test_concat_takes_each_record_once_and_interleave_over_repeats_the_smaller_set(tmp_path: Path) -> None:
    assert _decoded(tmp_path, "concat") == ["small"] * 4 + ["large"] * 12
    over = _decoded(tmp_path, "interleave_over")  # the default: equal shares until both sets are drawn completely
    assert over.count("large") == 12 and over.count("small") > 4
    under = _decoded(tmp_path, "interleave_under")  # stops when the first set runs out
    assert under.count("small") == 4 and under.count("large") < 12


def test_mix_settings_are_checked(tmp_path: Path) -> None:
    source = DataSource(_texts(tmp_path / "a.jsonl", "a", 2), weight=2.0)
    with pytest.raises(GymUserError, match="mix=concat takes every record once"):
        CausalLMDataModule(sources=[source, DataSource(source.path)], mix="concat")
    with pytest.raises(GymUserError, match="mix='shuffle' is unknown"):
        CausalLMDataModule(sources=[DataSource(source.path)], mix="shuffle")  # type: ignore[arg-type]
