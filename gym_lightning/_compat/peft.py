"""peft members patched for a while: the declared inventory and the patch (``gym_lightning._compat`` says why).
peft is imported lazily, inside the patch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# peft members patched for a while: (module, name), checked by tests/test_compat.py.
PEFT_MEMBERS: tuple[tuple[str, str], ...] = (
    # get_peft_model's bridge from transformers 4 to 5 LoRA targets (called by BaseTuner.inject_adapter).
    ("peft.utils.transformers_weight_conversion", "convert_peft_config_for_transformers"),
)


@contextlib.contextmanager
def peft_v4_target_conversion_off() -> Iterator[None]:
    """Inside, peft adapts what the LoRA config names in the model as transformers 5 built it.

    peft (0.21) rewrites the config of a mixture of experts on the way in, for adapters written for transformers 4's
    per-expert ``nn.Linear`` layers (``_convert_peft_config_moe``): any ``target_modules`` entry ending in
    ``gate_proj``/``up_proj``/``down_proj`` (``w1``/``w2``/``w3`` on Mixtral) or ``gate`` becomes the fused experts'
    or the router's ``target_parameters``. On Qwen3-MoE, ``all-linear`` then adapted every routed expert and the
    router (whose adapters peft's ``ParamWrapper`` builds as whole-stack deltas, refusing any dropout: configs/
    qlora.yaml's 0.05 failed with "lora.ParamWrapper does not work with lora_dropout != 0"), and DeepSeek-V3's dense
    MLP and shared experts could not be adapted at all. gym_lightning's settings name transformers 5's modules:
    linear layers by ``target_modules``, expert weights by ``target_parameters``."""
    from peft.utils import transformers_weight_conversion as conversion

    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


__all__ = ["PEFT_MEMBERS", "peft_v4_target_conversion_off"]
