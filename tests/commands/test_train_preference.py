"""``gym train``'s preference stages: TRL's DPOConfig/KTOConfig/ORPOConfig/CPOConfig flags and LLaMA-Factory's
``stage: dpo|kto`` keys become ``model.objective``'s init_args, its ranking and kto_tag ``dataset_info.json`` entries
become preference records, and what cannot be honoured is one line with its fix.

Pure: nothing trains here (``test_launch_lines.py`` runs TRL's and LLaMA-Factory's preference lines). TRL's own parser
is the reference for what a flag means; those tests skip where TRL is not installed (the floors' environment).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from launch_lines import LINES, LLAMA_FACTORY_DATASET_INFO, argv_for, program_args
from transformers import HfArgumentParser, TrainingArguments

from gym_lightning import cli
from gym_lightning.commands.train import parse_train_args, stages, to_cli_args, trl
from gym_lightning.commands.train.mapping import flag_notes
from gym_lightning.commands.train.problems import flag_problems
from gym_lightning.errors import GymUserError
from gym_lightning.objectives import DPO, OBJECTIVES
from gym_lightning.objectives.dpo import PairLogps, pair_losses

MODEL = ["--model_name_or_path", "tiny-llama"]


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.fixture
def pairs(tmp_path: Path) -> Path:
    return _jsonl(tmp_path / "pairs.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])


def _values(argv: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in to_cli_args(parse_train_args(argv), env={})[1:])


def _objective(argv: list[str]) -> dict[str, Any]:
    return json.loads(_values(argv)["model.objective"])


def _problems(argv: list[str]) -> list[str]:
    return flag_problems(parse_train_args(argv))


# ------------------------------------------------------------------------------------------------ TRL's flags
def test_trl_dpo_flags_are_the_dpo_objectives_settings(pairs: Path) -> None:
    argv = [*MODEL, "--train_file", str(pairs), "--stage", "dpo", "--beta", "0.2", "--loss_type", "sigmoid", "sft"]
    argv += ["--loss_weights", "1", "0.5", "--precompute_ref_log_probs", "--ref_model", "ref", "--no_disable_dropout"]
    argv += ["--f_divergence_type", "js_divergence", "--router_aux_loss_coef", "0.01", "--max_length", "64"]
    argv += ["--truncation_mode", "keep_end", "--max_prompt_length", "16"]
    values = _values(argv)
    assert json.loads(values["model.objective"]) == {
        "class_path": "gym_lightning.objectives.dpo.DPO",
        "init_args": {
            "beta": 0.2,
            "f_divergence_type": "js_divergence",
            "precompute_ref_log_probs": True,
            "ref_model": "ref",
            "disable_dropout": False,
            "router_aux_loss_coef": 0.01,
            "loss_type": ["sigmoid", "sft"],
            "loss_weights": [1.0, 0.5],
        },
    }
    expected = {"data.format": "preference", "data.max_seq_length": "64", "data.truncation_mode": "keep_end"}
    assert {key: values[key] for key in expected} == expected and values["data.max_prompt_length"] == "16"
    assert (values["data.packing"], values["data.mask_prompt"]) == ("false", "true")


def test_trl_kto_orpo_and_cpo_flags(pairs: Path) -> None:
    data = ["--train_file", str(pairs)]
    kto = _objective([*MODEL, *data, "--stage", "kto", "--desirable_weight", "1.3", "--loss_type", "apo_zero_unpaired"])
    assert kto == {
        "class_path": "gym_lightning.objectives.kto.KTO",
        "init_args": {"desirable_weight": 1.3, "loss_type": "apo_zero_unpaired"},
    }
    assert _values([*MODEL, *data, "--stage", "kto"])["data.format"] == "kto"
    orpo = _objective([*MODEL, *data, "--stage", "orpo", "--beta", "0.25"])
    assert orpo == {"class_path": "gym_lightning.objectives.orpo.ORPO", "init_args": {"beta": 0.25}}
    simpo = _objective([*MODEL, *data, "--stage", "simpo", "--simpo_gamma", "1.0", "--cpo_alpha", "0.5"])
    assert simpo["init_args"] == {"simpo_gamma": 1.0, "cpo_alpha": 0.5}
    alphapo = _objective([*MODEL, *data, "--stage", "simpo", "--loss_type", "alphapo", "--alpha", "0.2"])
    assert alphapo["init_args"] == {"alpha": 0.2, "cpo_alpha": 0.0}  # TRL's CPOConfig turns alphapo into simpo


def _trl_parse(config: str, flags: list[str], tmp_path: Path) -> Any:
    """What TRL 1.16's own parser makes of the flags (its config dataclass)."""
    module, _, name = trl.TRL_CONFIG_PATHS[config].rpartition(".")
    cls = getattr(pytest.importorskip(module), name)
    # bf16: TRL's configs turn it on where supported, which a CPU is not.
    argv = [*flags, "--output_dir", str(tmp_path), "--bf16", "False"]
    (config_obj,) = HfArgumentParser(cls).parse_args_into_dataclasses(argv)
    return config_obj


@pytest.mark.parametrize(
    ("stage", "config", "flags"),
    [
        ("dpo", "DPOConfig", ["--beta", "0.3", "--loss_type", "robust", "--label_smoothing", "0.2"]),
        ("dpo", "DPOConfig", ["--loss_type", "sigmoid", "ipo", "--loss_weights", "0.7", "0.3", "--discopop_tau", "1"]),
        ("dpo", "DPOConfig", ["--f_divergence_type", "alpha_divergence", "--f_alpha_divergence_coef", "0.3"]),
        ("kto", "KTOConfig", ["--beta", "0.05", "--desirable_weight", "1.33", "--undesirable_weight", "0.5"]),
        ("kto", "KTOConfig", ["--precompute_ref_log_probs", "True", "--disable_dropout", "False"]),
        ("orpo", "ORPOConfig", ["--beta", "0.5", "--disable_dropout", "False"]),
        ("simpo", "CPOConfig", ["--simpo_gamma", "0.8", "--cpo_alpha", "0.1"]),
        ("simpo", "CPOConfig", ["--beta", "2.0", "--label_smoothing", "0.1", "--alpha", "0.25"]),
    ],
)
def test_each_flag_means_what_trls_config_makes_of_it(
    stage: str, config: str, flags: list[str], pairs: Path, tmp_path: Path
) -> None:
    """The same flags through TRL 1.16's parser and through gym train: every init_arg the objective gets equals the
    TRL config's field of that name (TRL's loss_type is a list in DPOConfig, a name in KTOConfig/CPOConfig)."""
    theirs = _trl_parse(config, flags, tmp_path)
    init_args = _objective([*MODEL, "--train_file", str(pairs), "--stage", stage, *flags])["init_args"]
    given = {flag[2:] for flag in flags if flag.startswith("--")}
    assert given <= set(init_args)
    for name in given:
        assert init_args[name] == getattr(theirs, name), name


def test_field_defaults_are_trl_1_16s() -> None:
    """A stage takes another config's field at TRL 1.16's default of it: every field some config lacks is recorded,
    with the default each config that has it gives."""
    pytest.importorskip("trl")
    base = {spec.name for spec in dataclasses.fields(TrainingArguments)}
    configs = {name: _trl_parse_class(name) for name in trl.TRL_CONFIGS}
    everywhere = set.intersection(*(set(table) for table in trl.TRL_CONFIGS.values()))
    for name, cls in configs.items():
        for spec in dataclasses.fields(cls):
            if spec.name in base or not spec.init or spec.name in everywhere:
                continue
            default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
            default = default[0] if isinstance(default, list) and len(default) == 1 else default
            assert default in trl.FIELD_DEFAULTS[spec.name], (name, spec.name, default)


def _trl_parse_class(config: str) -> type:
    module, _, name = trl.TRL_CONFIG_PATHS[config].rpartition(".")
    return getattr(pytest.importorskip(module), name)


# ------------------------------------------------------------------------------------------ LLaMA-Factory's keys
def _lf(tmp_path: Path, **keys: Any) -> list[str]:
    """An LLaMA-Factory YAML of ``keys`` over a stage dpo base (preference pairs as its data file)."""
    data = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    config = {"model_name_or_path": "tiny-llama", "stage": "dpo", "finetuning_type": "lora", "dataset": str(data)}
    (tmp_path / "lf.yaml").write_text(yaml.safe_dump(config | keys))
    return [str(tmp_path / "lf.yaml")]


@pytest.mark.parametrize(
    ("keys", "objective", "init_args"),
    [
        ({"pref_beta": 0.2, "pref_loss": "sigmoid"}, "dpo", {"beta": 0.2, "loss_type": ["sigmoid"]}),
        ({"pref_loss": "hinge"}, "dpo", {"loss_type": ["hinge"]}),
        (
            {"pref_loss": "ipo", "pref_ftx": 0.5, "ref_model": "ref"},
            "dpo",
            {"ref_model": "ref", "loss_type": ["ipo", "sft"], "loss_weights": [1.0, 0.5], "sft_average": "sequence"},
        ),
        (
            {"dpo_label_smoothing": 0.1},
            "dpo",
            {"label_smoothing": 0.1, "loss_type": ["sigmoid", "robust"], "loss_weights": [1.8, -0.8]},
        ),
        ({"pref_loss": "orpo", "pref_beta": 0.3}, "orpo", {"beta": 0.3, "sft_average": "sequence"}),
        (
            {"pref_loss": "simpo", "simpo_gamma": 1.0, "pref_ftx": 0.2},
            "simpo",
            {"simpo_gamma": 1.0, "cpo_alpha": 0.2, "sft_average": "sequence"},
        ),
        (
            {"stage": "kto", "pref_beta": 0.2, "kto_chosen_weight": 1.5, "kto_rejected_weight": 0.5},
            "kto",
            {"beta": 0.2, "desirable_weight": 1.5, "undesirable_weight": 0.5},
        ),
    ],
    ids=["sigmoid", "hinge", "ipo-ftx", "cdpo", "orpo", "simpo-ftx", "kto"],
)
def test_llama_factory_preference_keys(
    keys: dict[str, Any], objective: str, init_args: dict[str, Any], tmp_path: Path
) -> None:
    cls = OBJECTIVES[objective]
    assert _objective(_lf(tmp_path, **keys)) == {
        "class_path": f"{cls.__module__}.{cls.__qualname__}",
        "init_args": init_args,
    }
    if "dpo_label_smoothing" in keys:  # said in one info line
        notes = flag_notes(parse_train_args(_lf(tmp_path, **keys)))
        assert any("--dpo_label_smoothing 0.1: LLaMA-Factory's smoothed sigmoid (cDPO)" in note for note in notes)


def test_cdpo_is_the_sum_of_trls_sigmoid_and_robust_losses() -> None:
    """LLaMA-Factory's dpo_label_smoothing e (TRL < 1's sigmoid: -(1-e) logsigmoid(b x) - e logsigmoid(-b x), x the
    chosen-minus-rejected log-ratio) equals loss_type [sigmoid, robust] weighted [2(1-e), -(1-2e)] with label_smoothing
    e, TRL 1.16's formulas as the DPO objective computes them."""
    torch.manual_seed(0)
    logps = PairLogps(*(torch.randn(64, dtype=torch.float64) * 5 for _ in range(4)), torch.ones(64), torch.ones(64))
    for smoothing in (0.05, 0.2, 0.45):
        settings = stages.STAGES["dpo"].settings(parse_train_args([*MODEL, "--dpo_label_smoothing", str(smoothing)]))
        objective = DPO(**settings)  # type: ignore[misc]
        ours = sum(weight * pair_losses(logps, loss, objective) for loss, weight in objective.weights())
        x = objective.beta * ((logps.chosen - logps.ref_chosen) - (logps.rejected - logps.ref_rejected))
        cdpo = -(1 - smoothing) * F.logsigmoid(x) - smoothing * F.logsigmoid(-x)
        torch.testing.assert_close(ours, cdpo, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"pref_loss": "kto_pair"}, "--pref_loss kto_pair: LLaMA-Factory's pairwise KTO is no TRL 1.16 loss type"),
        ({"pref_loss": "ipo", "dpo_label_smoothing": 0.1}, "--dpo_label_smoothing smooths the sigmoid loss alone"),
        ({"dpo_label_smoothing": 0.6}, "--dpo_label_smoothing 0.6: give a value in [0, 0.5)."),
        ({"pref_loss": "orpo", "pref_ftx": 0.1}, "a second NLL term beside ORPO's own"),
        ({"stage": "kto", "pref_ftx": 0.1}, "an NLL term on the desirable completions"),
        ({"stage": "kto", "pref_loss": "ipo"}, "--pref_loss 'ipo' is not supported: read by --stage dpo, orpo, simpo"),
        ({"pref_loss": "simpo", "ref_model": "ref"}, "--ref_model 'ref' is not supported: read by --stage dpo, kto"),
        ({"pref_bco_weight": 0.5}, "pref_bco_weight 0.5 is not supported: BCO's running reward baseline"),
        ({"ref_model_adapters": "a"}, "merge the adapters into it first"),
        ({"ref_model_quantization_bit": 4}, "the reference is held in the policy's dtype"),
        ({"ld_alpha": 0.5}, "--ld_alpha 0.5 is not supported: LD-DPO"),
        ({"pref_beta": -1.0}, "--stage dpo: beta must be > 0, got -1.0."),
    ],
)
def test_what_llama_factory_has_and_gym_train_cannot_honour_is_one_line(
    keys: dict[str, Any], message: str, tmp_path: Path
) -> None:
    problems = _problems(_lf(tmp_path, **keys))
    assert len(problems) == 1 and message in problems[0], problems


def test_llama_factorys_defaults_change_nothing_in_the_other_stages(tmp_path: Path) -> None:
    """An SFT YAML may carry the preference keys at LLaMA-Factory's defaults (they are read by stage dpo only)."""
    keys = {"stage": "sft", "pref_beta": 0.1, "pref_loss": "sigmoid", "pref_ftx": 0.0, "dpo_label_smoothing": 0.0}
    keys |= {"kto_chosen_weight": 1.0, "simpo_gamma": 0.5, "dataset": "addition"}
    assert _problems(_lf(tmp_path, **keys)) == []


def test_trl_loss_type_and_pref_loss_choose_one_loss(pairs: Path) -> None:
    argv = [*MODEL, "--train_file", str(pairs), "--stage", "dpo", "--loss_type", "ipo", "--pref_loss", "hinge"]
    assert _problems(argv) == ["--pref_loss and --loss_type both choose the loss; pass one (LLaMA-Factory's or TRL's)."]


def test_a_refused_stage_is_one_line_with_the_way_out(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["train", *MODEL, "--dataset", "addition", "--stage", "grpo", "--beta", "0.2", "--loss_type", "x"])
    # (its rows, SFTConfig's loss_type and the others' beta, are not checked: the stage's one line says it all)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "1 problem(s)" in err  # the stage's line says it all
    assert "--stage grpo (group relative policy optimisation): online RL" in err
    assert "gym train runs the stages sft, pt, dpo, kto, orpo and simpo" in err


# ----------------------------------------------------------------------------------------- dataset_info.json
def _info(tmp_path: Path, entries: dict[str, Any], *flags: str) -> tuple[dict[str, str] | None, list[str]]:
    folder = tmp_path / "data"
    folder.mkdir(exist_ok=True)
    for entry in entries.values():
        (folder / entry["file_name"]).write_text("[]")
    (folder / "dataset_info.json").write_text(json.dumps(entries))
    argv = [*MODEL, "--dataset", ",".join(entries), "--dataset_dir", str(folder), *flags]
    problems = _problems(argv)
    return (None if problems else _values(argv)), problems


def test_llama_factorys_ranking_and_kto_tag_entries_are_preference_records(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    demo = {name: LLAMA_FACTORY_DATASET_INFO[name] for name in ("dpo_en_demo",)}
    values, _ = _info(tmp_path, demo, "--stage", "dpo")
    assert values is not None and values["data.format"] == "preference" and "data.columns" not in values
    assert json.loads(values["data.train_files"]) == [str(folder / "dpo_en_demo.json")]
    values, _ = _info(tmp_path, {"kto_en_demo": LLAMA_FACTORY_DATASET_INFO["kto_en_demo"]}, "--stage", "kto")
    assert values is not None and values["data.format"] == "kto" and "data.columns" not in values
    # Column names of their own: alpaca ranking, sharegpt ranking, alpaca and chat kto_tag entries.
    alpaca = {"file_name": "a.json", "ranking": True, "columns": {"prompt": "q", "chosen": "good", "rejected": "bad"}}
    chats = {"file_name": "c.json", "ranking": True, "formatting": "sharegpt", "columns": {"messages": "conv"}}
    chats["columns"] |= {"chosen": "better", "rejected": "worse", "system": "sys"}
    values, _ = _info(tmp_path, {"a": alpaca, "c": chats}, "--stage", "dpo")
    assert values is not None
    assert [(s["format"], s.get("columns")) for s in json.loads(values["data.sources"])] == [
        ("preference", {"instruction": "q", "chosen": "good", "rejected": "bad"}),
        ("preference", {"conversations": "conv", "chosen": "better", "rejected": "worse", "system": "sys"}),
    ]
    feedback = {"file_name": "k.json", "columns": {"prompt": "q", "response": "a", "kto_tag": "ok"}}
    openai = {"file_name": "m.json", "formatting": "openai", "columns": {"messages": "turns", "kto_tag": "ok"}}
    values, _ = _info(tmp_path, {"k": feedback, "m": openai}, "--stage", "kto")
    assert values is not None
    assert [(s["format"], s.get("columns")) for s in json.loads(values["data.sources"])] == [
        ("kto", {"instruction": "q", "output": "a", "label": "ok"}),
        ("kto", {"messages": "turns", "label": "ok"}),
    ]
    # Stage kto reads ranking pairs too (a desirable and an undesirable example each, as TRL's KTO).
    values, _ = _info(tmp_path, demo, "--stage", "kto")
    assert values is not None and values["data.format"] == "kto"


@pytest.mark.parametrize(
    ("entry", "flags", "message"),
    [
        ({"ranking": True}, [], "preference data (ranking: true): train it with --stage dpo, orpo or simpo"),
        ({"columns": {"kto_tag": "ok"}}, ["--stage", "pt"], "preference data (a kto_tag column)"),
        ({}, ["--stage", "dpo"], "SFT data (neither ranking: true nor a kto_tag column): the stage reads preference"),
        ({"columns": {"kto_tag": "ok"}}, ["--stage", "dpo"], "unpaired feedback (a kto_tag column): train it with"),
        ({"ranking": True, "columns": {"kto_tag": "ok"}}, ["--stage", "kto"], "both ranking: true and a kto_tag"),
        ({"ranking": True, "columns": {"response": "r"}}, ["--stage", "dpo"], "columns response are not alpaca"),
    ],
)
def test_a_dataset_info_entry_the_stage_cannot_read_is_named(
    entry: dict[str, Any], flags: list[str], message: str, tmp_path: Path
) -> None:
    _, problems = _info(tmp_path, {"set": {"file_name": "set.json", **entry}}, *flags)
    assert len(problems) == 1 and f"dataset_info.json set: {message}" in problems[0], problems


# --------------------------------------------------------------------------------------------- the launch lines
def _line(name: str) -> Any:
    (line,) = [line for line in LINES if line.name == name]
    return line


def test_trls_commands_name_their_stage() -> None:
    assert program_args("trl dpo --model_name_or_path m")[1][:2] == ["--stage", "dpo"]
    assert program_args("trl kto --model_name_or_path m")[1][:2] == ["--stage", "kto"]
    assert program_args("python trl/scripts/dpo.py --beta 0.1")[1] == ["--stage", "dpo", "--beta", "0.1"]
    assert program_args("trl sft --model_name_or_path m")[1][0] == "--model_name_or_path"


@pytest.mark.parametrize(
    ("name", "objective", "init_args"),
    [
        ("llamafactory_lora_dpo", "gym_lightning.objectives.dpo.DPO", {"beta": 0.1, "loss_type": ["sigmoid"]}),
        ("llamafactory_lora_kto", "gym_lightning.objectives.kto.KTO", {"beta": 0.1}),
    ],
)
def test_llama_factorys_preference_examples_map(
    name: str, objective: str, init_args: dict[str, Any], tmp_path: Path
) -> None:
    """examples/train_lora/llama3_lora_dpo.yaml and llama3_lora_kto.yaml (their model, output and dataset_dir changed,
    as the matrix runs them): LoRA on every linear layer, the objective, the demo data set through dataset_info.json."""
    from gym_lightning.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = "{% for m in messages %}<|start_header_id|>{{ m['content'] }}<|eot_id|>{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps(LLAMA_FACTORY_DATASET_INFO))
    places = {"model": str(tmp_path / "model"), "data": str(tmp_path / "data"), "out": str(tmp_path / "out")}
    argv = argv_for(_line(name), places | {"nproc": "1"})
    values = _values(argv[1:])
    assert json.loads(values["model.objective"]) == {"class_path": objective, "init_args": init_args}
    assert json.loads(values["model.lora"]) == {"r": 8, "alpha": 16, "target_modules": ["all-linear"]}
    demo = "dpo_en_demo" if "dpo" in name else "kto_en_demo"
    (source,) = json.loads(values["data.sources"])
    fmt = "preference" if "dpo" in name else "kto"
    assert source == {"path": str(tmp_path / "data" / f"{demo}.json"), "format": fmt, "max_samples": 1000}
    assert values["data.format"] == fmt and values["trainer.precision"] == "bf16-mixed"


def test_trls_dpo_lines_map(tmp_path: Path) -> None:
    """TRL's quickstart `trl dpo` line (a full finetune: the reference is a frozen copy) and trl/scripts/dpo.py's LoRA
    line (its --no_remove_unused_columns accepted, its evaluation on the set's test split)."""
    data = tmp_path / "trl-lib" / "ultrafeedback_binarized"
    for split in ("train", "test"):
        _jsonl(data / f"{split}.jsonl", [{"chosen": [{"role": "user", "content": "a"}], "rejected": []}])
    places = {"model": "tiny-llama", "data": str(tmp_path), "out": str(tmp_path / "out"), "nproc": "1"}
    quickstart = _values(argv_for(_line("trl_dpo_quickstart"), places)[1:])
    assert json.loads(quickstart["model.objective"])["init_args"] == {"loss_type": ["sigmoid"]}
    assert "model.lora" not in quickstart and quickstart["data.format"] == "preference"
    script = _values(argv_for(_line("trl_dpo_script_lora"), places)[1:])
    assert json.loads(script["model.lora"]) == {"r": 32, "alpha": 16}
    assert json.loads(script["data.val_files"]) == [str(data / "test.jsonl")]
    assert (script["trainer.max_steps"], script["model.lr"]) == ("2", "5e-06")
    # The quickstart line keeps TrainingArguments' learning rate, not DPOConfig's: one info line says so.
    notes = flag_notes(parse_train_args(argv_for(_line("trl_dpo_quickstart"), places)[1:]))
    assert any("--learning_rate 5e-05 is TrainingArguments' default" in note and "1e-06" in note for note in notes)
    assert not any(
        "--learning_rate" in note
        for note in flag_notes(parse_train_args(argv_for(_line("trl_dpo_script_lora"), places)[1:]))
    )


def test_gym_user_error_names_the_flags_of_a_refused_combination(pairs: Path) -> None:
    with pytest.raises(GymUserError, match="--stage simpo: beta must be > 0"):
        to_cli_args(parse_train_args([*MODEL, "--train_file", str(pairs), "--stage", "simpo", "--beta", "-1"]))
