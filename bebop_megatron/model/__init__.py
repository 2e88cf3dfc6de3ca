"""Model families, the MTP-aware GPT model builder and backbone freezing."""

from bebop_megatron.model.builder import (
    MTPGPTModel,
    build_model,
    freeze_backbone,
    is_mtp_param,
    mtp_parameters,
    output_weight_of,
    padded_vocab_size,
    transformer_config,
    use_transformer_engine,
)

__all__ = [
    "MTPGPTModel", "build_model", "freeze_backbone", "is_mtp_param", "mtp_parameters", "output_weight_of",
    "padded_vocab_size", "transformer_config", "use_transformer_engine",
]
