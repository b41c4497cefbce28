"""4-bit base weights for QLoRA: the NF4 format (``nf4``), the layer that holds it (``NF4Linear``), the fused
expert weights of a mixture of experts held in it (``experts``), its settings (``QuantizationArgs``) and the
builder/loader pieces (``models.quantized``)."""

from gym_lightning.quant.config import QuantizationArgs
from gym_lightning.quant.linear import NF4Linear

__all__ = ["NF4Linear", "QuantizationArgs"]
