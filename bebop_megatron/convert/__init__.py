"""Checkpoint conversion: Hugging Face -> Megatron (import) and Megatron -> vLLM/SGLang (export).

- ``hf_config``: which HF architectures are supported and the model config they map to.
- ``layers``: the decoder-layer key map (fused QKV and gate/up split and joined; MLA one to one).
- ``formats``: one explicit MTP key map per export format (``mimo``, ``glm4_moe``, ``deepseek``;
  ``qwen3_next`` / ``qwen3_5`` in ``qwen3_next.py`` / ``qwen3_5.py``, hybrid configs in ``qwen_config.py``).
- ``handoff``: what draft step k hands step k+1 in training and in each engine (``engine_handoffs``);
  ``serve``: the NextN serve command the GLM, DeepSeek and Qwen exports print.
- ``importer`` / ``exporter``: the two directions (``importer.load_hf_model`` builds an HF
  directory in memory, as ``tools/speculative_generate.py`` reads an export); ``verify``: the independent K-step MTP forward
  (``qwen_verify``: the Qwen3-Next / Qwen3.5 reference, registered there).

Conversions run in one process at TP=1: Megatron's distributed checkpointing reshards the
written checkpoint to any TP/PP/EP layout on load, and reads any layout back at TP=1.
"""

from bebop_megatron.convert.errors import ConvertError

__all__ = ["ConvertError"]
