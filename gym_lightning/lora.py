"""LoRA (low-rank adapters, Hu et al. 2021, https://arxiv.org/abs/2106.09685) through the ``peft`` library."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from gym_lightning._compat import peft_v4_target_conversion_off, zero3_full_shape
from gym_lightning.errors import EveryRankError, GymUserError
from gym_lightning.quant import experts as nf4_experts
from gym_lightning.quant.linear import NF4Linear
from gym_lightning.settings import settings_from


@dataclass(frozen=True)
class LoRAArgs:
    """LoRA settings.

    Args:
        r: Rank of the update matrices (>= 1).
        alpha: Scaling numerator; the update is multiplied by ``alpha / r``.
        dropout: Dropout on the LoRA branch's input, in [0, 1).
        target_modules: Names of the linear layers to adapt; ``None`` uses peft's default for the architecture
            (e.g. ``q_proj`` and ``v_proj`` for Llama) unless ``target_parameters`` is set (then the experts alone
            are adapted), ``["all-linear"]`` adapts every linear layer but the head and the MoE routers.
        target_parameters: The 3-D expert weights of a mixture of experts to adapt (peft's ``target_parameters``,
            e.g. ``["experts.gate_up_proj", "experts.down_proj"]``); ``["all-experts"]`` adapts every routed
            expert's weights and the shared experts' linear layers of every MoE family. The router stays frozen
            unless ``target_modules`` names it.
    """

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] | None = None
    target_parameters: list[str] | None = None

    def problems(self) -> list[str]:
        found = []
        if self.r < 1:
            found.append(f"lora.r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            found.append(f"lora.dropout must be in [0, 1), got {self.dropout}")
        names = self.target_parameters
        if names is not None and (
            isinstance(names, str) or not names or not all(isinstance(n, str) and n.strip() for n in names)
        ):
            found.append(
                f"lora.target_parameters must be a non-empty list of parameter names (e.g. experts.gate_up_proj) or "
                f"[{EXPERTS_SHORTHAND}], got {names!r}"
            )
        return found

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    @classmethod
    def from_value(cls, value: LoRAArgs | Mapping[str, Any] | None) -> LoRAArgs | None:
        """``value`` as ``LoRAArgs``: as given, or built from a mapping of its fields; ``None`` stays ``None``.

        A checkpoint made by ``gym fit`` stores the module's hyper-parameters as the command line parsed them, so
        ``lora`` is a plain dict there (LightningCLI's instantiator); Python callers pass ``LoRAArgs``. Both mean the
        same settings, and every reader of a ``lora`` value goes through here.
        """
        return settings_from(cls, value, "lora", "LoRA settings (r, alpha, dropout, target_modules, target_parameters)")


# ``lora.target_parameters: [all-experts]``: every routed expert's 3-D weights and the shared experts' linear layers,
# whatever the family calls them (``models.experts.expert_targets`` finds them in the model).
EXPERTS_SHORTHAND = "all-experts"
# transformers 5's fused routed-expert weight every MoE family has (a model holding one has experts to adapt).
EXPERTS_WEIGHT = "gate_up_proj"


@dataclass(frozen=True)
class ExpertTargets:
    """The mixture-of-experts names of one model that the LoRA settings resolve against (``models.experts``).

    Args:
        parameters: peft ``target_parameters`` of the routed experts' 3-D weights (``experts.gate_up_proj``, ...).
        shared: peft ``target_parameters`` of the shared experts' linear weights (``shared_experts.gate_proj.weight``,
            ...). Targets by parameter, not by module: peft (0.21) rewrites a ``target_modules`` entry ending in
            ``gate_proj``/``up_proj``/``down_proj`` into the routed experts' fused weights on every Qwen2-MoE-like
            family (``transformers_weight_conversion._convert_peft_config_moe``, its transformers 4 -> 5 bridge), on
            the way in (``get_peft_model``) and out (``PeftModel.from_pretrained``) alike, so the shared experts
            could not be adapted by name; parameter targets pass through unchanged.
        routers: Full names of the routers' linear layers, kept out of ``all-linear``.
    """

    parameters: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()
    routers: tuple[str, ...] = ()


def resolved_targets(args: LoRAArgs, experts: ExpertTargets | None) -> tuple[Any, list[str] | None, list[str]]:
    """``(target_modules, target_parameters, exclude_modules)`` for peft: the ``all-experts`` shorthand expanded
    with ``experts`` (the model's names), experts alone when only ``target_parameters`` is set, routers excluded
    from ``all-linear``."""
    experts = experts or ExpertTargets()
    parameters = list(args.target_parameters) if args.target_parameters else None
    modules: Any = "all-linear" if args.target_modules == ["all-linear"] else args.target_modules
    if parameters is not None and EXPERTS_SHORTHAND in parameters:
        parameters = [p for p in parameters if p != EXPERTS_SHORTHAND] + [*experts.parameters, *experts.shared]
        parameters = parameters or None
    if parameters is not None and modules is None:
        modules = []  # peft would add its default targets (q_proj, v_proj) to the experts asked for
    exclude = list(experts.routers) if modules == "all-linear" else []
    return modules, sorted(set(parameters)) if parameters else None, exclude


# peft's LoRA wrapper inserts ``base_layer`` into the name of the weight it adapts; the checkpoint has the original.
_WRAPPER_INFIXES = (".base_layer.",)


def checkpoint_key(name: str) -> str:
    """The checkpoint key of a state dict entry (the name components peft's wrapper inserts removed)."""
    for infix in _WRAPPER_INFIXES:
        # Repeated: one experts module with 2 targets nests 2 wrappers (``experts.base_layer.base_layer.down_proj``),
        # and str.replace does not see the second infix, whose leading "." the first one consumed.
        while infix in name:
            name = name.replace(infix, ".")
    return name


# The names peft gives the tensors it adds (lora_A, lora_B, lora_embedding_A/B, lora_magnitude_vector): none is in
# the base model's checkpoint.
_ADAPTER_KEY = re.compile(r"(^|\.)lora_[A-Za-z_]+(\.|$)")


def is_adapter_key(name: str) -> bool:
    """Whether a state dict key is a LoRA adapter's (added by peft, not in the base model's checkpoint)."""
    return _ADAPTER_KEY.search(name) is not None


def peft_lora_config(args: LoRAArgs, experts: ExpertTargets | None = None) -> Any:
    """The ``peft.LoraConfig`` of ``args`` (for training, and for the adapter_config.json of an export), the
    expert names resolved against ``experts`` (the model's, ``models.experts.expert_targets``).

    peft refuses ``lora_dropout`` on parameter targets (its ``ParamWrapper`` cannot factor the input out of a merged
    delta), so with ``target_parameters`` the config says 0: gym's routed forward applies ``args.dropout`` to the
    expert adapters itself and :func:`apply_lora` puts it back on the linear ones; an exported adapter (for
    inference, where dropout is off) then loads with ``PeftModel.from_pretrained``.
    """
    return _lora_config(args, *resolved_targets(args, experts))


def _lora_config(args: LoRAArgs, modules: Any, parameters: list[str] | None, exclude: list[str]) -> Any:
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise GymUserError("LoRA needs the 'peft' package: pip install 'gym-lightning[lora]'.") from err
    return LoraConfig(
        r=args.r,
        lora_alpha=args.alpha,
        lora_dropout=0.0 if parameters else args.dropout,
        target_modules=modules,
        target_parameters=parameters,
        exclude_modules=exclude or None,
        task_type="CAUSAL_LM",
    )


# The linear-layer names peft's transformers 4 -> 5 bridge rewrites into a mixture of experts' fused weights or its
# router when it loads an adapter (``transformers_weight_conversion._MOE_TARGET_MODULE_MAPPING``: Qwen2-MoE-like
# families' gate_proj/up_proj/down_proj/gate, Mixtral's w1/w2/w3/gate). ``PeftModel.from_pretrained`` has no switch
# for it, so an adapter that names such a linear layer (DeepSeek-V3's dense first MLP, its shared experts) by module
# reloads onto the experts instead, and the reloaded model's logits are not the trained ones
# (docs/benchmarks-history.md, "A LoRA adapter that peft's bridge rewrites").
PEFT_REWRITTEN_NAMES = frozenset({"gate_proj", "up_proj", "down_proj", "gate", "w1", "w2", "w3"})


def lora_config_for(model: torch.nn.Module, args: LoRAArgs, experts: ExpertTargets | None = None) -> Any:
    """The ``peft.LoraConfig`` gym applies to ``model`` (training, and the meta model an export rebuilds): that of
    :func:`peft_lora_config`, and on a mixture of experts every linear target whose name peft's loader would rewrite
    (:data:`PEFT_REWRITTEN_NAMES`) named by its weight instead (``mlp.gate_proj`` -> ``mlp.gate_proj.weight``): peft
    adapts the same layer with the same two factors and file keys (a 2-D ``ParamWrapper``; gym's forward computes
    it as ``lora.Linear`` does, ``models.experts``), and the exported adapter then loads where it was trained.
    A parameter target (a shared expert of ``all-experts``) whose layer a module target adapts already is dropped:
    peft cannot wrap one layer both ways."""
    config = peft_lora_config(args, experts)
    if not any(name.endswith(f".{EXPERTS_WEIGHT}") for name, _ in model.named_parameters()):
        return config
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    excluded = set(config.exclude_modules or ())
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    modules = config.target_modules
    if modules == "all-linear":
        targets = sorted({n.rpartition(".")[2] for n in linear if n not in excluded})
    else:
        targets = sorted(modules or ())
    by_weight = [t for t in targets if t.rpartition(".")[2] in PEFT_REWRITTEN_NAMES]
    by_module = [t for t in targets if t not in by_weight]
    kept = [n for n in linear if n not in excluded and any(_suffix(n, t) for t in by_module)]
    parameters = {p for p in config.target_parameters or () if not any(_suffix(n, p[: -len(".weight")]) for n in kept)}
    parameters |= {f"{t}.weight" for t in by_weight}
    return _lora_config(args, by_module, sorted(parameters) or None, sorted(excluded))


@contextmanager
def _logical_weights(model: torch.nn.Module, targets: Iterable[str]) -> Iterator[None]:
    """While open, each 4-bit weight a parameter target names looks to peft like the weight it stands for: a
    stride-0 view of one element with the logical shape (``[E, out, in]`` for fused experts, ``[out, in]`` for an
    ``NF4Linear``) in the compute dtype. peft sizes ``lora_A``/``lora_B`` from the targeted parameter's shape, and the
    codes are ``[.., C/2]`` integers. No storage is made; the codes are put back whatever happens."""
    targets = tuple(targets)
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    try:
        for name, module in model.named_modules() if targets else ():
            for weight in list(module._parameters):
                logical = _logical_weight(module, weight)
                if logical is None or not any(_suffix(f"{name}.{weight}", t) for t in targets):
                    continue
                codes = module._parameters[weight]
                stand_in = torch.zeros((), dtype=logical[1], device=codes.device).expand(*logical[0])
                module._parameters[weight] = torch.nn.Parameter(stand_in, requires_grad=False)
                swapped.append((module, weight, codes))
        yield
    finally:
        for module, weight, codes in swapped:
            module._parameters[weight] = codes


def _logical_weight(module: torch.nn.Module, weight: str) -> tuple[tuple[int, ...], torch.dtype] | None:
    """``(shape, compute dtype)`` of the 16-bit weight a 4-bit parameter stands for, else None."""
    if isinstance(module, NF4Linear) and weight == "weight":
        return (module.out_features, module.in_features), module.compute_dtype
    if nf4_experts.is_nf4(module, weight):
        return nf4_experts.logical_shape(module, weight), nf4_experts.compute_dtype(module, weight)
    return None


def _suffix(name: str, target: str) -> bool:
    """peft's module rule: ``target`` is the name or a dotted suffix of it."""
    return name == target or name.endswith(f".{target}")


def apply_lora(model: PreTrainedModel, args: LoRAArgs, experts: ExpertTargets | None = None) -> PreTrainedModel:
    """Wrap ``model`` in a peft ``PeftModel`` with only the adapters trainable, the adapters drawn by
    :func:`draw_adapters` from the CPU generator's state before the wrap (one rule for every strategy and device).
    ``experts`` (``models.experts.expert_targets``) resolves ``target_parameters``; the expert adapters' forward is
    gym's own (``models.experts.route_experts``, which the caller installs).

    Under ZeRO-3's ``zero.Init`` the adapters are partitioned as they are created; the strategy gives them peft's
    initialisation once the weights are in (``strategies.zero.stage3.draw_partitioned_adapters``).
    """
    from peft import get_peft_model

    _check_targets(model, args.target_modules)
    config = lora_config_for(model, args, experts)
    if args.target_parameters and not config.target_parameters:
        raise EveryRankError(
            f"lora.target_parameters {args.target_parameters} name no expert weight of {type(model).__name__} "
            f"({model.config.model_type}): it has no mixture-of-experts blocks with fused 3-D expert weights. Drop "
            "lora.target_parameters, or use a mixture-of-experts model (qwen3_moe, mixtral, gpt_oss, deepseek_v3)."
        )
    state = torch.get_rng_state()
    partitioned = any(zero3_full_shape(p) is not None for p in model.parameters())
    # peft casts bf16/fp16 adapters to fp32 by swapping each one's ``.data``; on a ZeRO-3 parameter that replaces the
    # placeholder and leaves DeepSpeed with a 0-element partition (an empty trainable group, an AssertionError in
    # its defragment: a bf16 checkpoint with LoRA under bf16-mixed). DeepSpeed's engine keeps bf16 module weights
    # and fp32 master partitions itself, so under ZeRO-3 the adapters stay in the module's dtype.
    with peft_v4_target_conversion_off(), _logical_weights(model, config.target_parameters or ()):
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=not partitioned)
    if config.target_parameters and args.dropout:
        _dropout_on_linear_adapters(peft_model, args.dropout)
    if not partitioned:
        torch.set_rng_state(state)
        draw_adapters(peft_model)
    else:  # drawn once the weights are in, from this same state: the adapters of every strategy are the same
        model.__dict__[ADAPTER_RNG_STATE] = state
    return peft_model


def _dropout_on_linear_adapters(model: torch.nn.Module, p: float) -> None:
    """peft made the config's dropout 0 for its parameter targets (:func:`peft_lora_config`): the linear layers'
    adapters get ``p`` back (the ``nn.Dropout`` peft's ``update_layer`` would have made)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    for module in model.modules():
        if isinstance(module, LoraLayer) and not isinstance(module, ParamWrapper):
            for adapter in module.lora_dropout:
                module.lora_dropout[adapter] = torch.nn.Dropout(p=p)


# Where ``apply_lora`` leaves the CPU generator state the adapters of a partitioned model are to be drawn from
# (``strategies.zero.stage3.draw_partitioned_adapters``), in the model's ``__dict__``: not a parameter or buffer.
ADAPTER_RNG_STATE = "_gym_adapter_rng_state"


def _check_targets(model: PreTrainedModel, targets: list[str] | None) -> None:
    """Named target modules that match no layer of ``model`` (peft's rule: the name, or its last components) are
    refused in one line that lists the names the model has, before peft raises its own multi-line error."""
    if not targets or targets == ["all-linear"]:
        return
    if any(name == t or name.endswith(f".{t}") for name, _ in model.named_modules() for t in targets):
        return
    linear = (name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear))
    have = sorted({name.rpartition(".")[2] for name in linear})
    experts = any(name.endswith(f".{EXPERTS_WEIGHT}") for name, _ in model.named_parameters())
    hint = (
        f" The fused expert weights are adapted by model.lora.target_parameters: [{EXPERTS_SHORTHAND}]."
        if experts
        else ""
    )
    raise EveryRankError(
        f"LoRA target_modules {targets} match no linear layer of {type(model).__name__} "
        f"({model.config.model_type}); its linear layers are named {', '.join(have)}. Set model.lora.target_modules "
        f"to some of these, or to ['all-linear'].{hint}"
    )


def draw_adapters(model: torch.nn.Module) -> None:
    """Give every LoRA adapter peft's own initialisation, drawn on the CPU, on the device it lives on.

    peft draws new adapters where the layer they adapt lives: with the CUDA generator for a model on the GPU
    (gym_ddp, ZeRO-1/2), and with no values at all on the meta device (sharded loading, a meta-device
    ``models.plan.BuildPlan``), where ``nn.Linear``'s own draw is skipped too. Drawing again here,
    layer by layer from the same generator state, makes the adapters depend on the seed alone. Meta adapters get
    CPU storage (they are small; sharding then keeps them, ``strategies.materialize``).
    """
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter in module.lora_A:
            parts = (module.lora_A[adapter], module.lora_B[adapter])
            devices = [next(part.parameters()).device for part in parts]
            for part, device in zip(parts, devices, strict=True):
                if device.type == "meta":
                    part.to_empty(device="cpu")
                else:
                    part.to("cpu")
            module.reset_lora_parameters(adapter, init_lora_weights=True)
            for part, device in zip(parts, devices, strict=True):
                if device.type not in ("cpu", "meta"):
                    part.to(device)
