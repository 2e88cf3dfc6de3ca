"""Hugging Face directory -> Megatron distributed checkpoint (``tools/convert_from_hf.py``).

Written next to the checkpoint: ``hf/`` (the source ``config.json`` and tokenizer files;
``data.tokenizer`` points at it, ``tools/convert_to_hf.py`` reads it) and
``bebop_model.yaml`` (the ``model:`` and ``mtp:`` sections a training config needs, and
``data.tokenizer`` when the source has tokenizer files).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from omegaconf import OmegaConf

from bebop_megatron.convert import formats, megatron_io, qwen_config
from bebop_megatron.convert.errors import ConvertError
from bebop_megatron.convert.hf_config import HFModel, describe, model_overrides, padded_vocab, read_config
from bebop_megatron.convert.hf_io import HFWeights, copy_tokenizer, write_json
from bebop_megatron.convert.layers import layer_to_megatron
from bebop_megatron.convert.qwen3_5 import VISION_FILE

MTP_INITS = ("random", "copy_last_layer")
DEFAULT_MTP_STEPS = 3  # the gamma the heads are usually served with (the paper evaluates gamma = 3)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def hf_to_megatron(w: HFWeights, hf: HFModel, vocab_rows: int, progress: bool = False) -> dict[str, torch.Tensor]:
    """Every backbone tensor (and the MTP layers a MiMo/GLM checkpoint holds), Megatron names, TP=1."""
    from tqdm import tqdm

    p = hf.prefix  # model. (Qwen3.5's multimodal release: model.language_model.)
    out = {"embedding.word_embeddings.weight": _pad_rows(w.get(f"{p}embed_tokens.weight"), vocab_rows),
           "decoder.final_layernorm.weight": w.get(f"{p}norm.weight")}
    if hf.tie_embeddings:
        if "lm_head.weight" in w:
            w.get("lm_head.weight")  # a tied checkpoint may still store the copy
    else:
        out["output_layer.weight"] = _pad_rows(w.get("lm_head.weight"), vocab_rows)
    for i in tqdm(range(hf.num_layers), desc="layers", unit="layer", disable=not progress):
        out.update(_layer(w, f"{p}layers.{i}.", f"decoder.layers.{i}.", hf, i))
    fmt = formats.IMPORT_FORMAT.get(hf.family)
    if hf.num_mtp_layers and fmt is not None:
        for i in range(hf.num_mtp_layers):
            try:
                out.update(fmt.to_megatron(w.get, i, hf.layer_at(hf.num_layers + i), hf.num_layers))
            except RuntimeError as err:
                raise ConvertError(f"MTP layer {i}: tensor shapes do not match config.json ({_first(err)})") from None
    return out


def _layer(w: HFWeights, hf_prefix: str, meg_prefix: str, hf: HFModel, i: int) -> dict:
    try:
        return layer_to_megatron(w.get, hf_prefix, meg_prefix, hf.layer_at(i))
    except RuntimeError as err:  # a reshape of a tensor with the wrong size
        raise ConvertError(f"{hf_prefix}*: tensor shapes do not match config.json ({_first(err)})") from None


def _qwen_mtp_layers(w: HFWeights, hf: HFModel, log) -> int:
    """Qwen3-Next / Qwen3.5: the MTP layers present in the files (the config may announce more)."""
    found = {int(k.split(".")[2]) for k in w.keys() if k.startswith("mtp.layers.") and k.split(".")[2].isdigit()}
    if len(found) > 1:
        raise ConvertError(f"the checkpoint has {len(found)} MTP layers sharing one mtp.fc / mtp.norm: Megatron's "
                           "MTP layers each have their own; only one is supported")
    if hf.num_mtp_layers and not found:
        log(f"note: config.json announces {hf.num_mtp_layers} MTP layer(s) but the files hold no mtp.* tensors: "
            "the MTP layer is initialised as for a model without one")
    return len(found)


def _first(err: Exception) -> str:
    return str(err).strip().splitlines()[0]


def copy_last_layer(tensors: dict, num_layers: int, num_mtp: int, layer_types=None) -> dict:
    """Warm start: each MTP decoder layer (and its final norm) from the last backbone layer (hybrid
    models: the last full-attention one, the MTP layer's kind)."""
    last = max((i for i in range(num_layers) if not layer_types or layer_types[i] == "full_attention"),
               default=num_layers - 1)
    src = f"decoder.layers.{last}."
    out = {}
    for i in range(num_mtp):
        dst = f"{formats.meg_mtp(i)}mtp_model_layer."
        out.update({dst + k[len(src):]: v.clone() for k, v in tensors.items() if k.startswith(src)})
        out[f"{formats.meg_mtp(i)}final_layernorm.weight"] = tensors["decoder.final_layernorm.weight"].clone()
    return out


@dataclass
class ImportedModel:
    """A Hugging Face model built as a Megatron model in memory (``load_hf_model``)."""

    model: torch.nn.Module
    cfg: object  # the Config it was built with
    hf: HFModel
    model_cfg: dict  # the ``model:`` section a training config needs
    num_mtp: int
    steps: int
    rows: int  # padded vocabulary rows
    vision: dict  # Qwen3.5's vision tower tensors (not part of the Megatron model)


def load_hf_model(hf_dir: str, *, mtp_num_steps: int | None = None, mtp_init: str = "random",
                  next_step_input: str = "post_norm", make_vocab_size_divisible_by: int = 128,
                  max_tensor_parallel: int = 8, progress: bool = True, log=print) -> ImportedModel:
    """Build ``hf_dir`` as a single-process Megatron model (CPU, fp32) with its weights; the
    MTP layers are imported when the checkpoint has them (else new, per ``mtp_init``)."""
    from tqdm import tqdm

    if mtp_init not in MTP_INITS:
        raise ConvertError(f"--mtp-init {mtp_init!r} must be one of {', '.join(MTP_INITS)}")
    hf = describe(read_config(hf_dir))
    w = HFWeights(hf_dir)
    if hf.family in qwen_config.QWEN_HYBRID:  # MTP weights are often left out (e.g. transformers' save)
        hf.num_mtp_layers = _qwen_mtp_layers(w, hf, log)
    num_mtp = hf.num_mtp_layers or 1
    # One MTP layer (imported or new) is reused for every step; several distinct layers run one step each.
    steps = mtp_num_steps or (num_mtp if num_mtp > 1 else DEFAULT_MTP_STEPS)
    if num_mtp > 1 and steps != num_mtp:
        raise ConvertError(f"the checkpoint has {num_mtp} MTP layers: --mtp-num-steps must be {num_mtp}")
    rows = padded_vocab(hf.vocab_size, make_vocab_size_divisible_by, max_tensor_parallel)
    model_cfg = model_overrides(hf, rows, make_vocab_size_divisible_by)
    cfg = megatron_io.make_config(model_cfg, num_mtp, steps, next_step_input)
    tensors = hf_to_megatron(w, hf, rows, progress)
    if not hf.num_mtp_layers and mtp_init == "copy_last_layer":
        tensors.update(copy_last_layer(tensors, hf.num_layers, num_mtp, hf.layer_types))
    vision = {k: w.get(k) for k in w.keys() if k.startswith("model.visual.")}  # Qwen3.5's vision tower
    extra = w.unused()
    if extra:
        raise ConvertError(f"{len(extra)} tensors of {hf_dir} are not mapped for {hf.family}, e.g. {extra[0]}")

    model = megatron_io.build(cfg)
    target = megatron_io.weights(model)
    unknown = sorted(set(tensors) - set(target))
    assert not unknown, f"key map produced names the model lacks: {unknown[:3]}"
    missing = sorted(k for k in set(target) - set(tensors) if not k.startswith("mtp."))
    assert not missing, f"key map left backbone tensors unset: {missing[:3]}"
    params = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    with torch.no_grad():
        for name, t in tqdm(tensors.items(), desc="tensors", unit="t", disable=not progress):
            if tuple(t.shape) != tuple(target[name].shape):
                raise ConvertError(f"shape mismatch for {name}: checkpoint {tuple(t.shape)}, "
                                   f"config.json implies {tuple(target[name].shape)}")
            params[name].copy_(t)
    return ImportedModel(model, cfg, hf, model_cfg, num_mtp, steps, rows, vision)


def _check_out(out_dir: str, overwrite: bool) -> None:
    """Refuse an ``out_dir`` whose contents would be lost: a Megatron checkpoint (a training run's
    ``iter_N`` or an earlier import) unless ``overwrite``; any other non-empty path always (the
    save deletes the directory first, so --overwrite must never reach a user's other files)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConvertError(f"--out {out_dir} exists and is not a directory")
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        return
    if not os.path.isfile(os.path.join(out_dir, "metadata.json")):
        raise ConvertError(f"--out {out_dir} is not empty and is not a Megatron checkpoint (--overwrite replaces only "
                           "a checkpoint); choose another directory")
    if not overwrite:
        kind = "an earlier import" if os.path.isfile(os.path.join(out_dir, "bebop_model.yaml")) else "a checkpoint"
        raise ConvertError(f"--out {out_dir} already holds a Megatron checkpoint ({kind}); pass --overwrite to "
                           "replace it, or choose another directory")


def convert_from_hf(hf_dir: str, out_dir: str, *, mtp_num_steps: int | None = None, mtp_init: str = "random",
                    make_vocab_size_divisible_by: int = 128, max_tensor_parallel: int = 8,
                    progress: bool = True, overwrite: bool = False, log=print) -> dict:
    """Write ``out_dir`` (a distributed checkpoint); returns the model/mtp config sections.
    An existing checkpoint there is replaced only with ``overwrite``."""
    _check_out(out_dir, overwrite)
    imported = load_hf_model(hf_dir, mtp_num_steps=mtp_num_steps, mtp_init=mtp_init,
                             make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                             max_tensor_parallel=max_tensor_parallel, progress=progress, log=log)
    model, hf, model_cfg, num_mtp, steps, rows, vision = (
        imported.model, imported.hf, imported.model_cfg, imported.num_mtp, imported.steps, imported.rows,
        imported.vision)
    megatron_io.save(out_dir, model)

    sections = {"model": model_cfg, "mtp": {"num_layers": num_mtp, "num_steps": steps}}
    hf_out = os.path.join(out_dir, "hf")
    os.makedirs(hf_out, exist_ok=True)
    write_json(os.path.join(hf_out, "config.json"), hf.config)
    if vision:  # not trained here; a full export writes it back (convert/qwen3_5.py)
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in vision.items()}, os.path.join(hf_out, VISION_FILE))
    copied = copy_tokenizer(hf_dir, hf_out)
    if copied:  # training on real data then tokenizes with the model's own tokenizer
        sections.setdefault("data", {})["tokenizer"] = os.path.abspath(hf_out)
    with open(os.path.join(out_dir, "bebop_model.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create(sections)))
    mtp_from = "imported" if hf.num_mtp_layers else ("copied from the last layer" if mtp_init != "random" else "random")
    log(f"wrote {out_dir}: {hf.family}, {hf.num_layers} layers, vocabulary {hf.vocab_size} -> {rows} rows "
        f"(the padded rows are masked in the loss), {num_mtp} MTP layer(s) ({mtp_from}); "
        f"tokenizer files: {', '.join(copied) or 'none found (set data.tokenizer yourself)'}")
    log(f"mtp.num_steps={steps} in bebop_model.yaml"
        + ("" if mtp_num_steps else " (the default: train as many steps as the heads will draft when served; "
                                    "change it with --mtp-num-steps)"))
    log(f"train with: model.backbone_checkpoint={out_dir} (or model.init_checkpoint to keep its MTP weights) "
        f"and the model/mtp{'/data.tokenizer' if copied else ''} settings of "
        f"{os.path.join(out_dir, 'bebop_model.yaml')}")
    return sections
