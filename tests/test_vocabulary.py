"""One vocabulary (``gym_lightning.vocabulary``): the strategy names, what each stands for, and the HF names of
settings are held once; Lightning's registry, the package's name list and docstring table, the planner's strategy
list, ``hf_auto``'s and ``gym train``'s messages all come from it."""

from __future__ import annotations

import re

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import gym_lightning.strategies
from gym_lightning.commands import train
from gym_lightning.planner.estimate import STRATEGIES, planner_strategy
from gym_lightning.strategies.zero import config, hf_auto
from gym_lightning.vocabulary import (
    DEEPSPEED_SETTINGS,
    SETTING_FLAGS,
    STRATEGY_CLASSES,
    STRATEGY_NAMES,
    STRATEGY_PRESETS,
    StrategyPreset,
)


@pytest.mark.parametrize("preset", STRATEGY_PRESETS, ids=lambda p: p.name)
def test_lightning_registers_each_preset_as_held(preset: StrategyPreset) -> None:
    entry = StrategyRegistry[preset.name]
    cls = entry["strategy"]
    assert f"{cls.__module__.split('.')[0]}.strategies.{cls.__name__}" == STRATEGY_CLASSES[preset.strategy_class]
    assert entry["description"] == preset.description and entry["init_params"] == dict(preset.init_args)


def test_the_package_names_and_docstring_table_are_the_presets() -> None:
    assert gym_lightning.strategies.STRATEGY_NAMES == STRATEGY_NAMES
    table = re.findall(r"^``(\w+)``\s", gym_lightning.strategies.__doc__ or "", flags=re.MULTILINE)
    assert tuple(table) == STRATEGY_NAMES


@pytest.mark.parametrize("preset", STRATEGY_PRESETS, ids=lambda p: p.name)
def test_every_preset_is_a_planner_row_of_its_layout(preset: StrategyPreset) -> None:
    (row,) = [s for s in STRATEGIES if s.trainer_strategy == preset.name]
    planned = planner_strategy(row.key, row.label, preset.strategy_class, preset.init_args, name=preset.name)
    assert planned == row


def test_hf_names_are_held_once() -> None:
    assert hf_auto.DEEPSPEED_SETTINGS is DEEPSPEED_SETTINGS and train.SETTING_FLAGS is SETTING_FLAGS
    # Every setting a DeepSpeed message names gets its gym train flag beside it.
    for key, setting in DEEPSPEED_SETTINGS.items():
        assert "(gym train: --" in train.flags_for_settings(f"{key}: {setting}"), setting


def test_the_nvme_folder_is_the_zero_infinity_preset_s() -> None:
    (infinity,) = [p for p in STRATEGY_PRESETS if p.name == "zero_infinity"]
    assert infinity.init_args["nvme_path"] == config.DEFAULT_NVME_PATH


def test_hf_fsdp_users_are_pointed_at_gym_fsdp() -> None:
    for flag in ("fsdp", "fsdp_config"):
        assert "--strategy gym_fsdp" in train.REFUSAL_REASONS[flag] and "gym_fsdp" in STRATEGY_NAMES
