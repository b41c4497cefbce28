"""``gym train``'s tables: every field of every source is mapped, accepted or refused with a reason, the manual
(docs/gym-train.md) is written from them, and a stage is a table row plus an objective.

Pure: nothing trains here (the pt stage's launch lines run in ``test_launch_lines.py``). The TRL tests compare with
TRL 1.16's configs and skip where TRL is not installed (the floors' environment); LLaMA-Factory is not installed, so
its fields come from ``llama_factory_fields.py``, read from its source at a pinned commit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar

import llama_factory_fields
import pytest
import yaml
from launch_lines import LINES, LLAMA_FACTORY_DATASET_INFO, LLAMA_FACTORY_QWEN3_PRETRAIN, argv_for
from transformers import TrainingArguments

from gym_lightning.commands.train import docs, hf, llama_factory_table, parse_train_args, stages, to_cli_args, trl
from gym_lightning.commands.train.mapping import flag_notes
from gym_lightning.commands.train.parser import LLAMA_FACTORY_KEYS, build_parser
from gym_lightning.commands.train.peft_script import PEFT_SCRIPT
from gym_lightning.commands.train.problems import flag_problems
from gym_lightning.commands.train.rows import NO_DEFAULT, Row
from gym_lightning.errors import GymUserError
from gym_lightning.objectives import OBJECTIVES, SFT

BASE = ["--model_name_or_path", "tiny-llama"]


def _fields(cls: type) -> set[str]:
    return {spec.name for spec in dataclasses.fields(cls) if spec.init}


def _values(*flags: str) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in to_cli_args(parse_train_args([*BASE, *flags]), env={})[1:])


def _problems(*flags: str) -> list[str]:
    return flag_problems(parse_train_args([*BASE, *flags]))


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


# ------------------------------------------------------------------------------------------------- field coverage
def _assert_reasoned(table: dict[str, Row], names: set[str]) -> None:
    missing = sorted(names - set(table))
    assert not missing, f"fields with no row (map, accept or refuse each): {missing}"
    assert all(table[name].note.strip() for name in names)


def test_every_training_arguments_field_has_a_row() -> None:
    _assert_reasoned(hf.TRAINING_ARGUMENTS, _fields(TrainingArguments))
    assert set(hf.TRAINING_ARGUMENTS) == _fields(TrainingArguments)  # and no row of a field transformers dropped


def _trl_config(config: str) -> type:
    module, _, name = trl.TRL_CONFIG_PATHS[config].rpartition(".")
    return getattr(pytest.importorskip(module), name)


@pytest.mark.parametrize("config", list(trl.TRL_CONFIGS))
def test_every_field_of_trls_trainer_configs_is_mapped_or_refused_with_a_reason(config: str) -> None:
    """TRL 1.16's SFTConfig, DPOConfig, KTOConfig and experimental ORPOConfig and CPOConfig: every field
    (TrainingArguments' too) has a row, and each row of the config's table is one of its fields beyond
    TrainingArguments."""
    pytest.importorskip("trl")
    fields = _fields(_trl_config(config))
    _assert_reasoned(hf.TRAINING_ARGUMENTS | trl.TRL_CONFIGS[config], fields)
    assert set(trl.TRL_CONFIGS[config]) == fields - _fields(TrainingArguments)


def test_trls_model_and_script_arguments_have_rows() -> None:
    pytest.importorskip("trl")
    from trl import ModelConfig, ScriptArguments
    from trl.scripts.utils import DatasetMixtureConfig

    _assert_reasoned(trl.MODEL_CONFIG, _fields(ModelConfig))
    script = _fields(ScriptArguments) | _fields(DatasetMixtureConfig)
    _assert_reasoned(trl.SCRIPT_ARGUMENTS, script)
    assert set(trl.SCRIPT_ARGUMENTS) == script and set(trl.MODEL_CONFIG) == _fields(ModelConfig)


@pytest.mark.parametrize(
    ("recorded", "table"),
    [
        (llama_factory_fields.MODEL, llama_factory_table.MODEL),
        (llama_factory_fields.DATA, llama_factory_table.DATA),
        (llama_factory_fields.FINETUNING, llama_factory_table.FINETUNING),
        (llama_factory_fields.TRAINING | llama_factory_fields.SEQ2SEQ, llama_factory_table.TRAINING),
    ],
    ids=["model", "data", "finetuning", "training"],
)
def test_every_llama_factory_hparam_is_mapped_or_refused_with_a_reason(
    recorded: dict[str, str], table: dict[str, Row]
) -> None:
    _assert_reasoned(table, set(recorded))
    assert set(table) == set(recorded), sorted(set(table) ^ set(recorded))


def test_every_row_reaches_a_flag_or_says_what_its_key_may_hold() -> None:
    """A mapped or refused field of TRL, PEFT's script or LLaMA-Factory that is a flag reaches it by its own name
    (an alias) or ``Row.flag``; an LLaMA-Factory key that is no flag is accepted or compared with its default."""
    keys = build_parser().key_destinations()
    dests = set(keys.values())
    tables = [trl.SCRIPT_ARGUMENTS, trl.MODEL_CONFIG, *trl.TRL_CONFIGS.values(), PEFT_SCRIPT, hf.RUN_CLM]
    for table in tables:
        for name, row in table.items():
            assert name in keys or row.flag in dests, name
    for name, row in LLAMA_FACTORY_KEYS.items():
        if name in keys or row.flag in dests:
            continue
        assert row.kind != "mapped", f"{name} is mapped but no flag"
        assert row.kind == "accepted" or row.default is not NO_DEFAULT, f"{name}: refused without its default"
        recorded = {**llama_factory_fields.MODEL, **llama_factory_fields.DATA, **llama_factory_fields.FINETUNING}
        if row.kind == "refused" and name in recorded:  # the default the table compares with is LLaMA-Factory's
            assert repr(row.default) == recorded[name] or str(row.default) == recorded[name], name


# --------------------------------------------------------------------------------------------------------- manual
def test_the_manual_is_written_from_the_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/gym-train.md's tables are the tables: a row without its doc line (or a doc line without its row) fails
    here until `python -m gym_lightning.commands.train.docs` writes them again."""
    assert docs.main(["--check"]) == 0
    text = docs.DOC.read_text()
    for heading, (_, table) in docs.source_tables().items():
        section = text.split(f"### {heading}\n", 1)[1].split("\n### ", 1)[0]
        assert [line.split("`")[1] for line in section.splitlines() if line.startswith("| `")] == list(table)
    stale = tmp_path / "gym-train.md"
    stale.write_text(text.replace("| `use_cache` | refused |", "| `use_cachet` | refused |"))
    monkeypatch.setattr(docs, "DOC", stale)
    assert docs.main(["--check"]) == 1
    monkeypatch.setitem(hf.TRAINING_ARGUMENTS, "new_field", Row("refused", "a reason"))
    monkeypatch.setattr(docs, "DOC", docs.DOC.with_name("other.md"))
    docs.DOC.write_text(text)
    assert docs.main(["--check"]) == 1  # a row the manual lacks


def test_the_readme_points_at_the_manual() -> None:
    readme = (docs.DOC.parents[1] / "README.md").read_text()
    assert "docs/gym-train.md" in readme and "commands/train.py`'s docstring" not in readme


# --------------------------------------------------------------------------------------------------------- stages
def test_the_preference_stages_run_their_objectives() -> None:
    """dpo, kto, orpo and simpo are rows with an objective and settings; rm, ppo, grpo and online DPO stay refused."""
    for name, objective in {"dpo": "dpo", "kto": "kto", "orpo": "orpo", "simpo": "simpo"}.items():
        stage = stages.STAGES[name]
        assert stage.refusal is None and stage.objective == objective and stage.settings is not None
        assert OBJECTIVES[objective].name == objective
    assert {stage.trl for stage in stages.STAGES.values()} == set(trl.TRL_CONFIGS)
    for name in ("rm", "ppo", "grpo", "online_dpo"):
        assert stages.STAGES[name].refusal and stages.STAGES[name].objective is None
    # Their record formats come from the batches their objectives read (no data_settings of their own).
    assert stages.data_settings(stages.STAGES["dpo"]) == {"format": "preference"}
    assert stages.data_settings(stages.STAGES["kto"]) == {"format": "kto"}
    assert stages.data_settings(stages.STAGES["sft"]) == {}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # TRL's loss_type means what the stage's config says: DPOConfig's sigmoid is no SFTConfig loss.
        (["--loss_type", "sigmoid"], "--loss_type 'sigmoid' is not supported: SFTConfig's loss_type is nll here"),
        (["--loss_type", "sigmoid"], "DPOConfig's loss types (sigmoid, ipo, hinge, ...) are --stage dpo's"),
        (["--beta", "0.2"], "--beta 0.2 is not supported: a field of DPOConfig, KTOConfig, ORPOConfig and CPOConfig"),
        (["--beta", "0.2"], "(--stage dpo, kto, orpo, simpo), not of --stage sft's SFTConfig: drop it."),
        (["--desirable_weight", "2"], "a field of KTOConfig (--stage kto), not of --stage sft's SFTConfig"),
        (["--stage", "dpo", "--desirable_weight", "2"], "a field of KTOConfig (--stage kto), not of --stage dpo's"),
        (
            ["--stage", "kto", "--truncation_mode", "keep_end"],
            "a field of SFTConfig and DPOConfig (--stage sft, pt, dpo)",
        ),
        (["--stage", "dpo", "--packing"], "--packing True is not supported: a field of SFTConfig (--stage sft, pt)"),
        (["--stage", "orpo", "--loss_type", "ipo"], "a field of SFTConfig, DPOConfig, KTOConfig and CPOConfig"),
        (["--stage", "simpo", "--loss_type", "ipo"], "CPO's own sigmoid, hinge and ipo losses are not wired in"),
        (["--stage", "kto", "--loss_type", "kto", "sigmoid"], "KTOConfig's loss_type is one name"),
        (["--stage", "dpo", "--loss_type", "nll"], "--stage dpo: loss_type ['nll'] is not a DPO loss type; choose"),
        (["--stage", "dpo", "--loss_type", "aot"], "--stage dpo: loss_type 'aot' sorts the log-ratios within a"),
        (["--stage", "dpo", "--beta", "0"], "--stage dpo: beta must be > 0, got 0.0."),
        (["--stage", "kto", "--desirable_weight", "-1"], "--stage kto: desirable_weight must be > 0, got -1.0."),
        (["--stage", "dpo", "--ld_alpha", "0.5"], "--ld_alpha 0.5 is not supported: LD-DPO weights the tokens"),
        (["--stage", "dpo", "--sync_ref_model"], "--sync_ref_model True is not supported: TR-DPO mixes the policy"),
        (["--stage", "dpo", "--use_weighting"], "--use_weighting True is not supported: WPO weights pairs"),
        (["--stage", "kto", "--precompute_ref_batch_size", "4"], "--per_device_eval_batch_size"),
        (["--stage", "orpo", "--ref_model", "m"], "--ref_model 'm' is not supported: read by --stage dpo, kto, not"),
        (["--stage", "orpo", "--generate_during_eval"], "gym predict generates"),
        (["--stage", "dpo", "--padding_free"], "preference rows are padded"),
        (["--stage", "dpo", "--dataset_text_field", "content"], "a field of SFTConfig (--stage sft, pt)"),
        (["--stage", "dpo"], "--dataset addition holds SFT records; the stage reads preference records."),
        (["--stage", "dpo", "--data_format", "kto"], "--stage dpo reads preference records: drop --data_format kto"),
        (["--max_prompt_length", "8"], "--max_prompt_length 8 is not supported: read by --stage dpo, kto, orpo, simpo"),
        (["--stage", "rm"], "--stage rm (reward modelling): a reward model is a sequence classifier"),
        (["--stage", "grpo"], "online RL: each step samples completions per prompt"),
        (["--stage", "ppo"], "online RL: each step generates completions and scores them"),
        (["--stage", "online_dpo"], "completions are generated and judged during training"),
        (
            ["--stage", "online_dpo"],
            "(offline DPO: --stage dpo); gym train runs the stages sft, pt, dpo, kto, orpo and simpo",
        ),
        (["--stage", "pt", "--data_format", "alpaca"], "--stage pt reads text records: drop --data_format alpaca"),
        (["--stage", "pt", "--completion_only_loss"], "--stage pt trains on every token: drop --completion_only_loss"),
    ],
)
def test_fields_mean_what_their_stage_says(flags: list[str], message: str, tmp_path: Path) -> None:
    """Each line is one problem; a preference stage reads a preference file (the bundled set is SFT data)."""
    pairs = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    preference = "--stage" in flags and flags[flags.index("--stage") + 1] in ("dpo", "kto", "orpo", "simpo")
    data = ["--dataset", "addition"] if flags == ["--stage", "dpo"] or not preference else ["--train_file", str(pairs)]
    problems = _problems(*data, *flags)
    assert len(problems) == 1 and message in problems[0], problems


def test_the_sft_loss_types_of_sftconfig_stay_accepted() -> None:
    assert _problems("--dataset", "addition", "--loss_type", "nll") == []
    assert _problems("--dataset", "addition", "--beta", "0.1", "--desirable_weight", "1.0") == []  # TRL's defaults
    assert _problems("--dataset", "addition", "--loss_type", "chunked_nll") == []


def test_stage_pt_is_raw_text_packed_every_token_a_target(tmp_path: Path) -> None:
    """TRL's plain-text SFT (dataset_text_field) as stage pt: the objective and its data settings."""
    data = _jsonl(tmp_path / "corpus.jsonl", [{"content": "a page of text"}])
    values = _values("--stage", "pt", "--dataset_name", str(data), "--dataset_text_field", "content")
    assert values["model.objective"] == "pt"
    assert OBJECTIVES["pt"].data_settings == {"format": "text", "packing": True, "mask_prompt": False}
    expected = {"data.format": "text", "data.packing": "true", "data.mask_prompt": "false"}
    assert {key: values[key] for key in expected} == expected
    assert json.loads(values["data.columns"]) == {"text": "content"}
    # A flag given wins over the stage's default (LLaMA-Factory's packing: false with stage: pt).
    assert _values("--stage", "pt", "--dataset_name", str(data), "--packing", "False")["data.packing"] == "false"
    assert "model.objective" not in _values("--dataset_name", str(data))  # sft: the module's default, as before
    assert any(
        "--stage pt: each text is cut" in note for note in flag_notes(parse_train_args([*BASE, "--stage", "pt"]))
    )


def test_llama_factory_pretraining_yaml_reads_c4_demo_through_dataset_info(tmp_path: Path) -> None:
    """examples/train_lora/llama3_lora_pretrain.yaml with its model and output changed and dataset_dir given:
    dataset_info.json's c4_demo entry (alpaca, prompt column text) is raw text in stage pt."""
    (line,) = [line for line in LINES if line.name == "llamafactory_lora_pretrain"]
    _jsonl(tmp_path / "c4_demo.jsonl", [{"text": "a web page"}])
    (tmp_path / "dataset_info.json").write_text(json.dumps(LLAMA_FACTORY_DATASET_INFO))
    config = yaml.safe_load(line.config or "") | {"model_name_or_path": "tiny-llama", "dataset_dir": str(tmp_path)}
    (tmp_path / "pt.yaml").write_text(yaml.safe_dump(config))
    values = dict(arg[2:].split("=", 1) for arg in to_cli_args(parse_train_args([str(tmp_path / "pt.yaml")]))[1:])
    assert values["model.objective"] == "pt" and values["data.format"] == "text"
    (source,) = json.loads(values["data.sources"])
    assert source == {"path": str(tmp_path / "c4_demo.jsonl"), "format": "text", "max_samples": 1000}
    assert (values["data.packing"], values["data.mask_prompt"], values["data.max_seq_length"]) == (
        "true",
        "false",
        "2048",
    )
    assert json.loads(values["model.lora"]) == {"r": 8, "alpha": 16, "target_modules": ["all-linear"]}


def test_both_llama_factory_pretraining_examples_are_the_same_run(tmp_path: Path) -> None:
    """qwen3_lora_pretrain.yaml (LLaMA-Factory's newer name of the example, not run by the matrix) becomes the same
    gym fit arguments as the llama3 one the matrix runs, but for the output folder."""
    (llama3,) = [line for line in LINES if line.name == "llamafactory_lora_pretrain"]
    _jsonl(tmp_path / "c4_demo.jsonl", [{"text": "a web page"}])
    (tmp_path / "dataset_info.json").write_text(json.dumps(LLAMA_FACTORY_DATASET_INFO))
    runs = []
    for line in (llama3, LLAMA_FACTORY_QWEN3_PRETRAIN):
        out = tmp_path / line.name
        argv = argv_for(line, {"model": "tiny-llama", "data": str(tmp_path), "out": str(out), "nproc": "1"})
        runs.append([arg.replace(str(out), "OUT") for arg in to_cli_args(parse_train_args(argv[1:]), env={})])
    assert runs[0] == runs[1] and "--model.objective=pt" in runs[0]


class _Probe(SFT):
    """An objective of a stage added by a test: a row plus an objective, nothing else."""

    name: ClassVar[str] = "probe"
    data_settings: ClassVar[dict[str, Any]] = {"format": "text", "packing": True, "mask_prompt": False}


def test_a_new_stage_is_a_table_row_plus_an_objective(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(OBJECTIVES, "probe", _Probe)
    row = stages.Stage("probe", "a test stage", "probe", "SFTConfig", "nowhere", settings=lambda args: {"k": 1})
    monkeypatch.setitem(stages.STAGES, "probe", row)
    values = _values("--dataset", "addition", "--stage", "probe")
    objective = json.loads(values["model.objective"])
    assert objective == {"class_path": f"{__name__}._Probe", "init_args": {"k": 1}}
    assert (values["data.format"], values["data.packing"], values["data.mask_prompt"]) == ("text", "true", "false")


# ------------------------------------------------------------------------------------------ LLaMA-Factory's keys
def test_llama_factory_keys_are_accepted_or_refused_by_their_rows(tmp_path: Path) -> None:
    config = {"model_name_or_path": "tiny-llama", "dataset": "addition", "vllm_maxlen": 1, "image_max_pixels": 3}
    config |= {"pref_beta": 0.1, "use_kt": False, "pref_loss": "ipo", "fp8": True, "ppo_epochs": 2}
    (tmp_path / "lf.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(GymUserError) as info:
        to_cli_args(parse_train_args([str(tmp_path / "lf.yaml")]), env={})
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 3  # inference and multimodal keys take any value; pref_beta and use_kt their default
    assert any("fp8 True is not supported: fp8 training is not wired in" in line for line in lines)
    assert any("ppo_epochs 2 is not supported: PPO" in line for line in lines)
    # pref_loss is stage dpo's: stage sft (this YAML's) refuses it unless at LLaMA-Factory's default, sigmoid.
    assert any(
        "--pref_loss 'ipo' is not supported: read by --stage dpo, orpo, simpo, not by --stage sft" in line
        for line in lines
    )


def test_llama_factory_mix_strategies_map_onto_data_mix(tmp_path: Path) -> None:
    first = _jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
    second = _jsonl(tmp_path / "b.jsonl", [{"text": "b"}])
    both = ["--dataset", f"{first},{second}"]
    concat = _values(*both)  # LLaMA-Factory's default: one after the other, as data.train_files concatenate them
    assert json.loads(concat["data.train_files"]) == [str(first), str(second)] and "data.mix" not in concat
    assert _values(*both, "--max_samples", "5")["data.mix"] == "concat"
    mixed = _values(*both, "--mix_strategy", "interleave_under", "--interleave_probs", "0.7,0.3")
    assert mixed["data.mix"] == "interleave_under"
    assert [source["weight"] for source in json.loads(mixed["data.sources"])] == [0.7, 0.3]
    assert "give one each" in _problems(*both, "--mix_strategy", "interleave_over", "--interleave_probs", "1")[0]
    assert "not wired in" in _problems(*both, "--mix_strategy", "interleave_once")[0]
    assert "weighs an interleave mix" in _problems(*both, "--interleave_probs", "0.5,0.5")[0]
