"""Resolve a model reference (preset, local folder or hub name) into a ``transformers`` causal LM.

Resolution order: a built-in preset name, then an existing local folder, then a Hugging Face Hub name. Nothing
here knows about parallelism: a strategy says how it wants the model built through the ``models.plan.BuildPlan``
the caller passes (a meta-device build, a recorded random initialisation), and wraps ``configure_model`` in its own
construction context (``zero.Init``), which is why the module calls the builder from ``configure_model``.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from gym_lightning._compat import zero3_init_open
from gym_lightning.errors import GymUserError
from gym_lightning.models.conversion import safetensors_files
from gym_lightning.models.plan import META, BuildPlan, WeightsSource, draw_on_cpu
from gym_lightning.models.presets import PRESETS, is_preset, preset_config
from gym_lightning.quant.config import QuantizationArgs

DType = Literal["auto", "float32", "bfloat16", "float16"]
AttnImplementation = Literal["eager", "sdpa", "flash_attention_2", "flex_attention"]

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


# What a meta-device build reads from a hub repository: its safetensors shards and their index (config.json is
# fetched by AutoConfig already). A repository that also has pytorch_model*.bin files does not download them.
_SAFETENSORS_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]


def safetensors_folder(source: str) -> str | None:
    """The local folder whose ``*.safetensors`` files a meta-device build loads from, or None if it has none.

    A local folder is itself; a hub name resolves to its snapshot in the Hugging Face cache (``HF_HUB_CACHE``),
    downloading only the safetensors files. Every rank calls this: huggingface_hub takes a file lock per file in the
    cache, so the ranks of a node download each file once and the others wait for it; with ``HF_HUB_OFFLINE=1`` a
    cached snapshot is used as it is. The sharded load then reads each rank's slices from those files
    (``strategies.materialize``), so no rank holds the whole model, as it would under ``from_pretrained``.
    """
    if Path(source).is_dir():
        return source if safetensors_files(source) else None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(source, allow_patterns=_SAFETENSORS_PATTERNS)
    except (LocalEntryNotFoundError, HfHubHTTPError, ValueError) as err:  # ValueError: not a valid repository id
        raise GymUserError(_offline_hint(source)) from err
    return folder if safetensors_files(folder) else None


def _offline_hint(source: str) -> str:
    return (
        f"Could not load {source!r}: it is not a built-in preset, not an existing local folder, and could not be "
        "fetched from the Hugging Face Hub (no network, a typo, or a gated repository). Pass a local folder that "
        f"holds config.json and weights, or a preset: {', '.join(sorted(PRESETS))}."
    )


def load_model_config(source: str, overrides: dict[str, Any] | None, trust_remote_code: bool) -> PretrainedConfig:
    """The model config for ``source`` with ``overrides`` applied; errors name unknown override keys."""
    if is_preset(source):
        config = preset_config(source)
    else:
        try:
            config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        except OSError as err:
            raise GymUserError(_offline_hint(source)) from err
    return apply_config_overrides(config, overrides or {})


def import_model_code(config: PretrainedConfig, trust_remote_code: bool = False) -> None:
    """Check that transformers can build ``config`` as a causal LM, and import the module that defines its class
    now (transformers imports it lazily, on the first build), so that no construction context is open when its
    classes are created. A model that cannot be built is refused in one line, before any rank loads weights.

    Why import early: DeepSpeed's ``zero.Init`` wraps the ``__init__`` of every ``nn.Module`` class created while it
    is open and, on exit, puts back the ``__init__`` the class had when it was created, which drops what a class
    decorator added after that. transformers' ``@use_experts_implementation`` (Qwen3-MoE, DeepSeek-V3, ... experts)
    sets ``self.config`` in the ``__init__`` it installs, so a second build of such a model in the same process (a
    second fit, a notebook) failed with "'DeepseekV3Experts' object has no attribute 'config'".
    """
    import transformers
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # the lazy mapping imports the modeling module on access
        return
    remote = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if remote and trust_remote_code:
        return
    hint = (
        "Its folder ships its own modeling code: set model.trust_remote_code=true if you trust that code."
        if remote
        else "gym_lightning finetunes decoder-only causal LMs (Llama, Qwen, Mistral, Gemma, the MoE families, ...): "
        "for an encoder-decoder or vision-language model, use a text-only causal LM checkpoint instead."
    )
    raise GymUserError(
        f"The model type {config.model_type!r} ({type(config).__name__}) has no causal-LM class in transformers "
        f"{transformers.__version__}: AutoModelForCausalLM cannot build it. {hint}"
    )


def apply_config_overrides(config: PretrainedConfig, overrides: dict[str, Any]) -> PretrainedConfig:
    """A new config of the same class with ``overrides`` passed to its constructor.

    Rebuilding (rather than setting attributes) lets the class re-derive dependent fields; per-layer lists such as
    ``layer_types`` are dropped when the layer count changes so that they are derived again for the new count.
    """
    unknown = sorted(key for key in overrides if not hasattr(config, key))
    if unknown:
        raise GymUserError(
            f"config_overrides has keys that {type(config).__name__} does not define: {', '.join(unknown)}. "
            "Use attribute names from the model's config.json (e.g. num_hidden_layers, hidden_size)."
        )
    if not overrides:
        return config
    values = config.to_dict()
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        values.pop("layer_types", None)
    values.update(overrides)
    return type(config)(**values)


def _torch_dtype(dtype: DType | None) -> torch.dtype | str | None:
    return dtype if dtype in (None, "auto") else getattr(torch, dtype)


def _has_weights(source: str) -> bool:
    folder = Path(source)
    return not folder.is_dir() or any((folder / name).exists() for name in _WEIGHT_FILES)


def build_causal_lm(
    source: str,
    *,
    pretrained: bool = True,
    config_overrides: dict[str, Any] | None = None,
    dtype: DType | None = None,
    attn_implementation: AttnImplementation | None = None,
    trust_remote_code: bool = False,
    plan: BuildPlan | None = None,
    quantization: QuantizationArgs | None = None,
) -> PreTrainedModel:
    """Build the model named by ``source`` as ``plan`` asks (default: an ordinary build, ``models.plan``).

    Presets are always randomly initialised. Folders and hub names load their weights unless ``pretrained`` is
    False (a config-only folder then gives a randomly initialised model of that shape, e.g. for benchmarks). On a
    meta-device plan the model has no storage and ``plan`` records where its weights come from. With
    ``quantization`` the linear layers are built as ``quant.NF4Linear``, the fused expert weights as NF4 parts
    (``quant.experts``), and both quantised as they are read.
    """
    plan = plan if plan is not None else BuildPlan()
    config = load_model_config(source, config_overrides, trust_remote_code)
    options: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if dtype is not None:
        options["dtype"] = _torch_dtype(dtype)
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    random_init = is_preset(source) or not pretrained
    if quantization is not None:
        return _build_quantized(source, config, options, plan, quantization, random_init)
    if plan.on_meta and random_init:
        return _build_on_meta(None, config, options, plan)
    if plan.on_meta and _has_weights(source):
        if (folder := safetensors_folder(source)) is not None:
            return _build_on_meta(folder, config, options, plan)
        warnings.warn(
            f"{source!r} has no safetensors weights (pytorch_model*.bin only): every rank loads the whole model "
            "before it is sharded. Save it once with safetensors (model.save_pretrained(folder)) to load only each "
            "rank's shards.",
            stacklevel=2,
        )
    fill = plan.fill_pretrained and not random_init and _has_weights(source)
    if fill and (folder := safetensors_folder(source)) is not None:
        return _build_to_fill(folder, config, options, plan)
    if random_init:
        return _random_init(config, options, plan)
    if not _has_weights(source):
        raise GymUserError(
            f"The folder {source!r} has a config.json but no weights ({', '.join(_WEIGHT_FILES)}). "
            "Add the weights, or set model.pretrained=false to train that shape from a random initialisation."
        )
    try:
        return AutoModelForCausalLM.from_pretrained(source, config=config, **options)
    except OSError as err:
        raise GymUserError(_offline_hint(source)) from err


def _build_quantized(
    source: str,
    config: PretrainedConfig,
    options: dict[str, Any],
    plan: BuildPlan,
    args: QuantizationArgs,
    random_init: bool,
) -> PreTrainedModel:
    """The model with its linear layers and fused expert weights in NF4, never built in 16 bits: on the meta device
    and filled here, one tensor at a time (the default plan), or left to the strategy as its plan asks (sharded:
    each rank quantises the rows, or whole experts, it holds)."""
    from gym_lightning.models.experts import install_routed_experts
    from gym_lightning.models.fill import fill_on_cpu
    from gym_lightning.models.quantized import nf4_experts, nf4_linears, restore_skipped

    folder = None if random_init or not _has_weights(source) else safetensors_folder(source)
    if folder is None:
        raise GymUserError(
            f"4-bit quantisation (model.quantization) quantises pretrained weights, and {source!r} has none in "
            "safetensors files (a preset, model.pretrained=false, or pytorch_model*.bin only). Use a folder or hub "
            "model with *.safetensors weights (re-save one with save_pretrained), or drop model.quantization."
        )
    options = _checkpoint_dtype(folder, config, options)
    record = WeightsSource(folder=folder, config=config, options=options, rng_state=torch.get_rng_state())
    deferred = plan.on_meta or plan.fill_pretrained  # the strategy reads each rank's rows
    with nf4_linears(args), META if plan.on_meta or not deferred else nullcontext():
        with nf4_experts(args, config):
            model = _uninitialised(config, options)
        restore_skipped(model, args)
    install_routed_experts(model)  # NF4 experts run gym's per-expert forward (transformers' reads the codes as weights)
    if deferred:
        plan.record(model, record)
        return model
    fill_on_cpu(model, record)
    target = torch.get_default_device()
    return model if target.type == "cpu" else model.to(target)


def _random_init(config: PretrainedConfig, options: dict[str, Any], plan: BuildPlan) -> PreTrainedModel:
    """A random initialisation drawn by the CPU generator, then placed on the caller's default device.

    One rule for every strategy and device: Lightning builds gym_ddp/zero1/zero2 models under ``torch.device(cuda)``,
    where ``from_config`` would draw from the CUDA generator, while gym_fsdp and ZeRO-3 replay the CPU draw
    (``reference_state_dict``); drawing on the CPU here makes the initial weights depend on the seed alone.
    On a plan that records the draw (ZeRO-3's, under ``zero.Init``) the build stays where the construction context
    puts it, and the strategy replaces it by the CPU draw.
    """
    record = WeightsSource(folder=None, config=config, options=options, rng_state=torch.get_rng_state())
    target = torch.get_default_device()
    if plan.record_random_init or target.type == "meta":  # meta: no values to draw
        model = AutoModelForCausalLM.from_config(config, **options)
    else:
        model = draw_on_cpu(config, options)
        model = model if target.type == "cpu" else model.to(target)
    if plan.record_random_init:
        plan.record(model, record)
    return model


def _build_to_fill(folder: str, config: PretrainedConfig, options: dict[str, Any], plan: BuildPlan) -> PreTrainedModel:
    """The model built where the construction context puts it (``from_config``), its weights left to the strategy,
    which reads them from ``folder`` (``BuildPlan.fill_pretrained``); ``plan`` records the folder."""
    options = _checkpoint_dtype(folder, config, options)
    record = WeightsSource(folder=folder, config=config, options=options, rng_state=torch.get_rng_state())
    model = _uninitialised(config, options)
    plan.record(model, record)
    return model


def _uninitialised(config: PretrainedConfig, options: dict[str, Any]) -> PreTrainedModel:
    """``from_config`` without transformers' weight initialisation (ties kept), for a model whose every weight the
    strategy then reads from a checkpoint. Under ZeRO-3 that initialisation gathers each module in turn to draw it
    on rank 0 (transformers' ``initialize_weights_zero3``, after the build, whatever ``no_init_weights`` says), the
    whole 16-bit embedding included, a load peak above what the ranks hold once loaded (benchmarks/qlora_peak.py
    --diagnose; docs/benchmarks-history.md, "Weight initialisation before a ZeRO-3 load"), for values the checkpoint
    then overwrites.
    The strategy's ``zero.Init`` is open already (``zero3_init_open`` says so to transformers); the rotary buffers
    it computes in the training dtype are replaced by the strategy (``models.plan.reference_buffers``)."""
    from transformers.initialization import no_init_weights

    with no_init_weights(), zero3_init_open():
        model = AutoModelForCausalLM.from_config(config, **options)
    model.tie_weights()
    return model


def _checkpoint_dtype(folder: str | None, config: PretrainedConfig, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with dtype ``"auto"`` (transformers 5's default, and no dtype) resolved as ``from_pretrained``
    does for a folder: the dtype the checkpoint was saved in."""
    if folder is not None and options.get("dtype", "auto") == "auto":
        return {**options, "dtype": config.dtype or torch.get_default_dtype()}
    return options


def _build_on_meta(
    folder: str | None, config: PretrainedConfig, options: dict[str, Any], plan: BuildPlan
) -> PreTrainedModel:
    """The model with all parameters and buffers on the meta device; ``plan`` records its ``WeightsSource``."""
    options = _checkpoint_dtype(folder, config, options)
    record = WeightsSource(folder=folder, config=config, options=options, rng_state=torch.get_rng_state())
    with META:
        model = AutoModelForCausalLM.from_config(config, **options)
    plan.record(model, record)
    return model
