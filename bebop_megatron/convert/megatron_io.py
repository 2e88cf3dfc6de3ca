"""The Megatron side of a conversion: one CPU process at TP=1, full (unsharded) tensors.

Megatron's distributed checkpointing reshards on load, so a checkpoint written here loads
at any TP/PP/EP layout, and a checkpoint written at any layout loads here.
"""

from __future__ import annotations

import os
import re

import torch

from bebop_megatron.convert.errors import ConvertError

MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def make_config(model: dict, mtp_layers: int, mtp_steps: int, next_step_input: str = "post_norm"):
    from bebop_megatron.config import load_config

    return load_config(defaults={
        "device": "cpu",
        "precision": "fp32",
        "model": {**model, "transformer_impl": "local"},
        "mtp": {"num_layers": mtp_layers, "num_steps": mtp_steps, "next_step_input": next_step_input},
        "parallel": {"tensor": 1, "pipeline": 1, "expert": 1},
        "save": {"dir": None},
        "train": {"resume": "none"},
    })


def build(cfg):
    """Process group of one (gloo), Megatron's parallel state at TP=1, and the model."""
    from bebop_megatron.model import build_model
    from bebop_megatron.platform import init_distributed
    from bebop_megatron.training.parallel import setup_parallel

    init_distributed("cpu")
    setup_parallel(cfg, 1)
    model = build_model(cfg, "cpu")
    model.eval()
    return model


def weights(model) -> dict[str, torch.Tensor]:
    """The model's tensors by their (TP=1) state-dict name, without ``_extra_state``."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory, or a ``save.dir`` whose ``latest`` names one."""
    from bebop_megatron.training.checkpoint import latest_checkpoint

    if not os.path.isdir(path):
        raise ConvertError(f"checkpoint directory not found: {path}")
    latest = latest_checkpoint(path)
    if latest is not None:
        return latest
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise ConvertError(f"{path} is not a Megatron distributed checkpoint (no metadata.json or 'latest')")
    return path


def checkpoint_shapes(path: str) -> dict[str, tuple]:
    """Global tensor shapes stored in a distributed checkpoint, by sharded key."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: tuple(v.size) for k, v in meta.items() if isinstance(v, TensorStorageMetadata)}


def num_mtp_layers(shapes: dict) -> int:
    return len({int(m.group(1)) for k in shapes if (m := MTP_LAYER.match(k))})


def has_backbone(shapes: dict) -> bool:
    return "embedding.word_embeddings.weight" in shapes


def load(path: str, model, keep) -> None:
    """Load the tensors whose names satisfy ``keep`` (all must be present)."""
    from megatron.core import dist_checkpointing

    from bebop_megatron.training.model_weights import filtered_sharded_state_dict, load_into

    sd = filtered_sharded_state_dict(model, keep)
    loaded = dist_checkpointing.load({"model": sd}, path)["model"]
    load_into(model, loaded, keep)


def save(path: str, model) -> None:
    from bebop_megatron.training.model_weights import save_model_checkpoint

    save_model_checkpoint(path, model)


@torch.no_grad()
def forward_hidden_and_logits(model, tokens_BS: torch.Tensor, vocab_size: int):
    """Hidden states and logits ``[B, S, *]`` of ``[backbone, mtp_1, ..., mtp_K]`` (TP=1);
    the backbone's hidden state is after its final norm; padded vocabulary rows are cut."""
    B, S = tokens_BS.shape
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
    hidden = model(tokens_BS, position_ids, None)  # [(1+K)*S, B, H]
    hiddens, logits = [], []
    for h_SBH in torch.split(hidden, S, dim=0):
        logits_SBV, _ = model.output_layer(h_SBH, weight=model.output_weight())
        hiddens.append(h_SBH.transpose(0, 1).float())
        logits.append(logits_SBV.transpose(0, 1)[..., :vocab_size].float())
    return hiddens, logits
