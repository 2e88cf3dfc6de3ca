"""Megatron checkpoint (any layout) -> Hugging Face directory for vLLM / SGLang
(``tools/convert_to_hf.py``); formats ``mimo``, ``glm4_moe``, ``deepseek`` (DeepSeek-V3),
``qwen3_next`` and ``qwen3_5``.

Full export: backbone and MTP layers in the format's names, ``config.json`` with the MTP
field set, sharded safetensors with an index, tokenizer files. ``--mtp-only``: the draft
checkpoint alone, with the embedding/head copies the target engine's loader needs.
"""

from __future__ import annotations

import os

import torch

from bebop_megatron.convert import megatron_io, qwen_verify, verify as verify_mod
from bebop_megatron.convert.backbone_check import check_backbone
from bebop_megatron.convert.errors import ConvertError
from bebop_megatron.convert.formats import TARGETS, Glm4Moe, MiMo, get_format
from bebop_megatron.convert.qwen3_5 import vision_tensors
from bebop_megatron.convert.qwen3_next import Qwen3Next
from bebop_megatron.convert.hf_config import describe, model_overrides, read_config
from bebop_megatron.convert.hf_io import copy_tokenizer, read_all, write_json, write_sharded
from bebop_megatron.convert.layers import layer_to_hf


def export_tensors(sd: dict, hf, fmt, num_mtp: int, target: str, mtp_only: bool) -> dict[str, torch.Tensor]:
    """HF-named tensors (vocabulary padding cut, cast to the source dtype)."""
    V = hf.vocab_size
    emb = sd["embedding.word_embeddings.weight"][:V]
    head = sd["output_layer.weight"][:V] if "output_layer.weight" in sd else emb
    sglang_nextn = issubclass(fmt, Glm4Moe) and target == "sglang" and mtp_only  # embedding/head from the target
    qwen = issubclass(fmt, Qwen3Next)
    p = fmt.backbone_prefix(hf.config) if qwen else "model."  # Qwen3.5 multimodal: model.language_model.
    out: dict[str, torch.Tensor] = {}
    if not sglang_nextn and (fmt is MiMo or qwen or not mtp_only):
        out[f"{p}embed_tokens.weight"] = emb
    if fmt is MiMo or (qwen and fmt.writes_head(hf.config)):  # vLLM's drafts check lm_head.weight was loaded
        out["lm_head.weight"] = head
    if not mtp_only:
        if not hf.tie_embeddings:
            out["lm_head.weight"] = head
        out[f"{p}norm.weight"] = sd["decoder.final_layernorm.weight"]
        for i in range(hf.num_layers):
            out.update(layer_to_hf(sd, f"decoder.layers.{i}.", f"{p}layers.{i}.", hf.layer_at(i),
                                   qkv_bias=fmt.backbone_qkv_bias))
    for i in range(num_mtp):
        extra = {"sglang_nextn": True} if sglang_nextn else {}
        out.update(fmt.to_hf(sd, i, hf.layer_at(hf.num_layers + i), hf.num_layers, emb=emb, head=head, **extra))
    return {k: v.to(torch.float32 if k.endswith("e_score_correction_bias") else hf.dtype) for k, v in out.items()}


def expected_shapes(fmt, config: dict, num_mtp: int, target: str, mtp_only: bool) -> dict[str, tuple]:
    """Names and shapes the engine's loader reads, from the written config alone."""
    out = {}
    V, H = (config["vocab_size"], config["hidden_size"]) if "vocab_size" in config else (0, 0)
    if not mtp_only:
        out.update(fmt.expected_backbone_shapes(config))
    elif fmt is MiMo:
        out.update({"model.embed_tokens.weight": (V, H), "lm_head.weight": (V, H)})
    elif issubclass(fmt, Qwen3Next):
        out.update(fmt.expected_shared_shapes(config))
    for i in range(num_mtp):
        out.update(fmt.expected_mtp_shapes(config, i, target, mtp_only))
    return out


def _prepare_out(out_dir: str, inputs: list) -> None:
    """Create ``out_dir``; remove an earlier export's weight files (a different shard count
    would leave stale shards); never write into an input directory."""
    real = os.path.realpath(out_dir)
    if any(p and os.path.realpath(p) == real for p in inputs):
        raise ConvertError(f"--out {out_dir} is one of the input directories")
    if os.path.isfile(os.path.join(out_dir, "metadata.json")):
        raise ConvertError(f"--out {out_dir} holds a Megatron checkpoint; refusing to write into it")
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, name))


def _hf_dir(explicit, candidates) -> str:
    if explicit:
        return explicit
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "hf", "config.json")):
            return os.path.join(c, "hf")
    raise ConvertError("no hf/config.json next to the checkpoints (written by convert_from_hf.py): pass --hf-dir "
                       "with the source model's config.json and tokenizer")


def convert_to_hf(checkpoint: str, out_dir: str, fmt_name: str, target: str, *, backbone: str | None = None,
                  hf_dir: str | None = None, mtp_only: bool = False, verify: bool = True, tol: float = 1e-4,
                  progress: bool = True, allow_moved_backbone: bool = False, log=print) -> dict:
    """Write ``out_dir``; returns a summary (number of tensors, verification differences).

    ``backbone`` must be the one a training checkpoint's heads were trained on (its recorded
    path and fingerprint; with ``allow_moved_backbone`` the fingerprint alone)."""
    from tqdm import tqdm

    from bebop_megatron.model import is_mtp_param

    if target not in TARGETS:
        raise ConvertError(f"unknown --target {target!r} (choose from {', '.join(TARGETS)})")
    fmt = get_format(fmt_name)
    ckpt = megatron_io.resolve_checkpoint(checkpoint)
    shapes = megatron_io.checkpoint_shapes(ckpt)
    num_mtp = megatron_io.num_mtp_layers(shapes)
    if num_mtp == 0:
        raise ConvertError(f"{ckpt} holds no MTP layers")
    if backbone is None:
        if not megatron_io.has_backbone(shapes):
            raise ConvertError(f"{ckpt} holds only MTP weights (a training checkpoint): pass --backbone "
                               "(the model.backbone_checkpoint it was trained on)")
        bb = ckpt
    else:
        bb = megatron_io.resolve_checkpoint(backbone)
        check_backbone(_training_common(ckpt), ckpt, bb, allow_moved_backbone, log)
    bb_shapes = megatron_io.checkpoint_shapes(bb) if bb != ckpt else shapes
    if not megatron_io.has_backbone(bb_shapes):
        raise ConvertError(f"--backbone {bb} holds no backbone weights")
    hf = describe(read_config(_hf_dir(hf_dir, [backbone, checkpoint, bb])))
    fmt.check(hf.layer, hf.family, num_mtp, target, mtp_only)
    config = fmt.hf_config(hf.config, num_mtp, target, mtp_only)
    vision = {}  # Qwen3.5's multimodal layout: the vision tower, passed through unchanged (full export)
    if issubclass(fmt, Qwen3Next) and not mtp_only:
        vision = vision_tensors(hf_dir or _hf_dir(None, [backbone, checkpoint, bb]), config)
    rows = bb_shapes["embedding.word_embeddings.weight"][0]
    if rows < hf.vocab_size:
        raise ConvertError(f"checkpoint vocabulary {rows} < config.json vocab_size {hf.vocab_size}")

    # The Megatron model runs the chain the way the target engine does (verification compares
    # against that engine's semantics); see mtp.next_step_input.
    engine_chain = fmt.next_step_input(target)
    _warn_if_trained_otherwise(ckpt, engine_chain, target, log)
    cfg = megatron_io.make_config(model_overrides(hf, rows, 1), num_mtp, num_mtp, engine_chain)
    model = megatron_io.build(cfg)
    megatron_io.load(bb, model, lambda k: not is_mtp_param(k))
    megatron_io.load(ckpt, model, is_mtp_param)
    tensors = export_tensors(megatron_io.weights(model), hf, fmt, num_mtp, target, mtp_only)
    expected = expected_shapes(fmt, config, num_mtp, target, mtp_only)
    tensors.update(vision)
    expected.update({k: tuple(v.shape) for k, v in vision.items()})
    verify_mod.check_keys(tensors, expected)  # before anything is written

    _prepare_out(out_dir, [checkpoint, ckpt, bb, backbone, hf_dir])
    with tqdm(total=len(tensors), desc="tensors", unit="t", disable=not progress) as bar:
        write_sharded(tensors, out_dir, progress=bar)
    write_json(os.path.join(out_dir, "config.json"), config)
    for name, text in getattr(fmt, "extra_files", {}).items():
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)
    tok_src = hf_dir or _hf_dir(None, [backbone, checkpoint, bb])
    copy_tokenizer(tok_src, out_dir)
    summary = {"tensors": len(tensors), "num_mtp_layers": num_mtp}
    if verify:
        if hf.dtype != torch.float32:  # compare like with like: the written weights are rounded
            with torch.no_grad():
                for param in model.parameters():
                    param.copy_(param.to(hf.dtype).float())
        summary.update(verify_export(out_dir, model, fmt, config, expected, num_mtp, target, mtp_only,
                                     hf.vocab_size, tol))
        log(f"verified: {len(expected)} tensors with the expected names and shapes; "
            + ", ".join(f"{k} max|diff| {v:.2e}" for k, v in summary.items() if k.startswith("max_diff")))
    target_model = out_dir if not mtp_only else "<TARGET_MODEL_DIR>"
    log(f"wrote {out_dir}: {fmt_name} for {target}{' (MTP only)' if mtp_only else ''}, {len(tensors)} tensors, "
        f"{num_mtp} MTP layer(s)")
    log("serve with:\n  " + fmt.serve(out_dir, target, mtp_only, target_model, num_mtp))
    return summary


def _training_common(ckpt: str) -> dict | None:
    """A training checkpoint's common state (step, config, backbone record); None for a model
    checkpoint (convert_from_hf has none)."""
    import warnings

    from megatron.core import dist_checkpointing

    try:
        with warnings.catch_warnings():  # dist checkpointing's note on a missing process group
            warnings.simplefilter("ignore")
            common = dist_checkpointing.load_common_state_dict(ckpt).get("common")
    except (OSError, KeyError, RuntimeError):
        return None
    return common if isinstance(common, dict) else None


def _warn_if_trained_otherwise(ckpt: str, engine_chain: str, target: str, log) -> None:
    """One warning line when a training checkpoint's heads were trained with another
    ``mtp.next_step_input`` than the target engine runs (draft steps >= 2 then differ)."""
    from omegaconf import OmegaConf

    common = _training_common(ckpt) or {}
    text = common.get("config_yaml")
    if not text:
        return
    mtp = OmegaConf.create(text).get("mtp", {})
    trained = mtp.get("next_step_input", "post_norm")
    if trained != engine_chain and int(mtp.get("num_steps", 1)) > 1:
        log(f"warning: the MTP heads were trained with mtp.next_step_input={trained}, but {target} hands "
            f"the next draft step the {engine_chain.replace('_', '-')} state: acceptance from draft step 2 on "
            f"can be lower than training measured; train with mtp.next_step_input={engine_chain} for {target}")


def verify_export(out_dir, model, fmt, config, expected, num_mtp, target, mtp_only, vocab, tol) -> dict:
    """Reload the files, check the key set, and compare an independent MTP forward's logits."""
    written = read_all(out_dir)
    verify_mod.check_keys(written, expected)
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    hidden, logits = megatron_io.forward_hidden_and_logits(model, tokens, vocab)
    result = {}
    qwen = issubclass(fmt, Qwen3Next)
    if mtp_only:
        h = hidden[0]  # the backbone is not in the files: take its final hidden state from Megatron
    else:
        if qwen:
            h, ref_logits = qwen_verify.backbone_hidden(out_dir, written, config, tokens, fmt.name)
        elif fmt is MiMo:
            h, ref_logits = verify_mod.mimo_backbone_hidden(written, config, tokens)
        else:
            h, ref_logits = verify_mod.nextn_backbone_hidden(out_dir, config, tokens, fmt.name)
        result["max_diff_backbone"] = verify_mod.compare("backbone logits", logits[0], ref_logits, tol)
    if qwen:  # the target's embedding and head (the draft's copies are vLLM's loader's demand only)
        sd = megatron_io.weights(model)
        emb = sd["embedding.word_embeddings.weight"][:vocab]
        head = sd["output_layer.weight"][:vocab] if "output_layer.weight" in sd else emb
        drafts = qwen_verify.draft_logits(written, config, h, tokens, num_mtp, emb, head,
                                          pre_norm=fmt.next_step_input(target) == "pre_norm")
    elif fmt is MiMo:
        drafts = verify_mod.mimo_draft_logits(written, config, h, tokens, num_mtp,
                                              pre_norm=fmt.next_step_input(target) == "pre_norm")
    else:  # the target's embedding and head where the draft does not carry them
        sd = megatron_io.weights(model)
        emb = sd["embedding.word_embeddings.weight"][:vocab]
        head = sd["output_layer.weight"][:vocab] if "output_layer.weight" in sd else emb
        drafts = verify_mod.nextn_draft_logits(written, config, h, tokens, num_mtp, emb, head,
                                               sglang_nextn=target == "sglang" and mtp_only, fmt_name=fmt.name,
                                               pre_norm=fmt.next_step_input(target) == "pre_norm")
    for k, ref in enumerate(drafts, start=1):
        got = logits[k][:, : ref.shape[1]]
        result[f"max_diff_mtp{k}"] = verify_mod.compare(f"MTP step {k} logits", got, ref, tol)
    return result
