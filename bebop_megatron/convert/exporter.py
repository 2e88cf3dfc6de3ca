"""Megatron checkpoint (any layout) -> Hugging Face directory for vLLM / SGLang
(``tools/convert_to_hf.py``); formats ``mimo``, ``glm4_moe``, ``deepseek`` (DeepSeek-V3),
``qwen3_next`` and ``qwen3_5``.

Full export: backbone and MTP layers in the format's names, ``config.json`` with the MTP
field set, sharded safetensors with an index, tokenizer files. ``--mtp-only``: the draft
checkpoint alone, with the embedding/head copies the target engine's loader needs.
``--verify``: K draft steps of the Megatron model, chained as the heads were trained
(``mtp.next_step_input``), against an independent forward of the written files chained as
the target engine runs them (:mod:`bebop_megatron.convert.handoff`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from bebop_megatron.convert import handoff as handoff_mod, megatron_io, verify as verify_mod
from bebop_megatron.convert.backbone_check import check_backbone
from bebop_megatron.convert.errors import ConvertError
from bebop_megatron.convert.formats import TARGETS, Glm4Moe, MiMo, get_format
from bebop_megatron.convert.qwen3_5 import vision_tensors
from bebop_megatron.convert.qwen3_next import Qwen3Next
from bebop_megatron.convert.hf_config import describe, model_overrides, read_config
from bebop_megatron.convert.hf_io import copy_tokenizer, read_all, write_json, write_sharded
from bebop_megatron.convert.layers import layer_to_hf
from bebop_megatron.convert.source_check import check_out_apart, check_source, recorded_model


def trained_mtp_in_fp32(sd: dict, source_dtype: torch.dtype) -> bool:
    """Whether the MTP layers' weights must be written in float32 to be kept: some of them are not
    exactly representable in the (lower) source dtype, as trained float32 heads are (imported
    heads, which are, are written in the source dtype and round-trip bit-exactly)."""
    from bebop_megatron.model import is_mtp_param

    if source_dtype == torch.float32:
        return False
    return any(not torch.equal(t.float(), t.to(source_dtype).float())  # the router's expert bias is float32 anyway
               for k, t in sd.items() if is_mtp_param(k) and t.is_floating_point() and not k.endswith("expert_bias"))


def export_tensors(sd: dict, hf, fmt, num_mtp: int, target: str, mtp_only: bool,
                   mtp_fp32: bool = False) -> dict[str, torch.Tensor]:
    """HF-named tensors (vocabulary padding cut, cast to the source dtype; with ``mtp_fp32`` the MTP
    layers' own weights stay float32, their embedding/head copies take the source dtype)."""
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
    fp32 = set()
    for i in range(num_mtp):
        extra = {"sglang_nextn": True} if sglang_nextn else {}
        mtp = fmt.to_hf(sd, i, hf.layer_at(hf.num_layers + i), hf.num_layers, emb=emb, head=head, **extra)
        if mtp_fp32:
            fp32.update(k for k, v in mtp.items() if v is not emb and v is not head)
        out.update(mtp)
    return {k: v.to(torch.float32 if k.endswith("e_score_correction_bias") or k in fp32 else hf.dtype)
            for k, v in out.items()}


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


def _check_out(out_dir: str, overwrite: bool) -> None:
    """Before any work: never write into a Megatron checkpoint, nor into a non-empty directory
    (a user's files, an earlier export) unless ``overwrite``."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConvertError(f"--out {out_dir} exists and is not a directory")
    if os.path.isfile(os.path.join(out_dir, "metadata.json")):
        raise ConvertError(f"--out {out_dir} holds a Megatron checkpoint; refusing to write into it")
    entries = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if entries and not overwrite:
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise ConvertError(f"--out {out_dir} is not empty ({shown}); pass --overwrite to write into it (files of the "
                           "same names are replaced, earlier weight files removed), or choose another directory")


def _prepare_out(out_dir: str) -> None:
    """Create ``out_dir``; remove an earlier export's weight files (a different shard count
    would leave stale shards)."""
    if os.path.isfile(os.path.join(out_dir, "metadata.json")):
        raise ConvertError(f"--out {out_dir} holds a Megatron checkpoint; refusing to write into it")
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, name))


def _import_hf_dir(candidates) -> str | None:
    """The ``hf/`` directory convert_from_hf.py wrote next to the first of ``candidates`` with one."""
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "hf", "config.json")):
            return os.path.join(c, "hf")
    return None


def _hf_dir(explicit, candidates) -> str:
    if explicit:
        return explicit
    found = _import_hf_dir(candidates)
    if found:
        return found
    raise ConvertError("no hf/config.json next to the checkpoints (written by convert_from_hf.py): pass --hf-dir "
                       "with the source model's config.json and tokenizer")


def convert_to_hf(checkpoint: str, out_dir: str, fmt_name: str, target: str, *, backbone: str | None = None,
                  hf_dir: str | None = None, mtp_only: bool = False, verify: bool = True, tol: float = 1e-4,
                  progress: bool = True, allow_moved_backbone: bool = False, num_steps: int | None = None,
                  vllm_handoff: str | None = None, overwrite: bool = False, round_mtp: bool = False,
                  log=print) -> dict:
    """Write ``out_dir``; returns a summary (number of tensors, verification differences).
    A non-empty ``out_dir`` is refused unless ``overwrite``.

    ``backbone`` must be the one a training checkpoint's heads were trained on (its recorded
    path and fingerprint; with ``allow_moved_backbone`` the fingerprint alone). ``num_steps``:
    draft steps K to verify and serve (default: the trained ``mtp.num_steps``);
    ``vllm_handoff``: ``pre_norm`` for the DeepSeek-V3 / GLM-4.5 drafts of vLLM releases before
    PR #45895 (see :mod:`bebop_megatron.convert.handoff`). Trained float32 MTP weights that the
    source dtype (e.g. bf16) would round are written in float32 unless ``round_mtp``."""
    from tqdm import tqdm

    from bebop_megatron.model import is_mtp_param

    if target not in TARGETS:
        raise ConvertError(f"unknown --target {target!r} (choose from {', '.join(TARGETS)})")
    fmt = get_format(fmt_name)
    check_out_apart(out_dir, {"--checkpoint": checkpoint, "--backbone": backbone, "--hf-dir": hf_dir})
    _check_out(out_dir, overwrite)
    engine = handoff_mod.engine_handoff(fmt, target, vllm_handoff)
    ckpt = megatron_io.resolve_checkpoint(checkpoint)
    shapes = megatron_io.checkpoint_shapes(ckpt)
    num_mtp = megatron_io.num_mtp_layers(shapes)
    if num_mtp == 0:
        raise ConvertError(f"{ckpt} holds no MTP layers")
    common = _training_common(ckpt)
    if backbone is None:
        if not megatron_io.has_backbone(shapes):
            raise ConvertError(f"{ckpt} holds only MTP weights (a training checkpoint): pass --backbone "
                               "(the model.backbone_checkpoint it was trained on)")
        bb = ckpt
    else:
        bb = megatron_io.resolve_checkpoint(backbone)
        check_backbone(common, ckpt, bb, allow_moved_backbone, log)
    bb_shapes = megatron_io.checkpoint_shapes(bb) if bb != ckpt else shapes
    if not megatron_io.has_backbone(bb_shapes):
        raise ConvertError(f"--backbone {bb} holds no backbone weights")
    source = _hf_dir(hf_dir, [backbone, checkpoint, bb])  # the source config.json, tokenizer (and vision tower)
    hf = describe(read_config(source))
    imported_hf = _import_hf_dir([backbone, checkpoint, bb])
    check_source(source, hf_dir is not None, hf, bb_shapes["embedding.word_embeddings.weight"],
                 recorded_model(ckpt, common, bb),
                 imported_hf and os.path.join(imported_hf, "config.json"))
    fmt.check(hf.layer, hf.family, num_mtp, target, mtp_only)
    config = fmt.hf_config(hf.config, num_mtp, target, mtp_only)
    vision = {}  # Qwen3.5's multimodal layout: the vision tower, passed through unchanged (full export)
    if issubclass(fmt, Qwen3Next) and not mtp_only:
        vision = vision_tensors(source, config)
    rows = bb_shapes["embedding.word_embeddings.weight"][0]

    # The Megatron model runs K steps chained as the heads were trained; the reference chains
    # them as the target engine does, so a hand-off mismatch fails --verify from step 2 on.
    trained = handoff_mod.trained_chain(ckpt, common)
    K = handoff_mod.num_draft_steps(num_steps, trained, num_mtp, verify)
    if trained.handoff != engine and K > 1:
        log(handoff_mod.mismatch_warning(fmt, trained.handoff, engine, target))
    cfg = megatron_io.make_config(model_overrides(hf, rows, 1), num_mtp, K if verify else num_mtp, trained.handoff)
    model = megatron_io.build(cfg)
    megatron_io.load(bb, model, lambda k: not is_mtp_param(k))
    megatron_io.load(ckpt, model, is_mtp_param)
    sd = megatron_io.weights(model)
    mtp_fp32 = not round_mtp and trained_mtp_in_fp32(sd, hf.dtype)
    tensors = export_tensors(sd, hf, fmt, num_mtp, target, mtp_only, mtp_fp32)
    expected = expected_shapes(fmt, config, num_mtp, target, mtp_only)
    tensors.update(vision)
    expected.update({k: tuple(v.shape) for k, v in vision.items()})
    verify_mod.check_keys(tensors, expected)  # before anything is written

    _prepare_out(out_dir)
    with tqdm(total=len(tensors), desc="tensors", unit="t", disable=not progress) as bar:
        write_sharded(tensors, out_dir, progress=bar)
    write_json(os.path.join(out_dir, "config.json"), config)
    for name, text in getattr(fmt, "extra_files", {}).items():
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)
    copy_tokenizer(source, out_dir)
    summary = {"tensors": len(tensors), "num_mtp_layers": num_mtp, "num_steps": K, "handoff": engine,
               "mtp_dtype": "float32" if mtp_fp32 else str(hf.dtype).replace("torch.", "")}
    if mtp_fp32:
        log(f"the trained MTP weights are written in float32 ({str(hf.dtype).replace('torch.', '')} would round "
            "them; --round-mtp writes them in the source dtype)")
    if verify:
        if hf.dtype != torch.float32:  # compare like with like: the written weights are rounded
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if not (mtp_fp32 and is_mtp_param(name)):
                        param.copy_(param.to(hf.dtype).float())
        chain = Chain(num_mtp, K, engine, trained.handoff, target)
        summary.update(verify_export(out_dir, model, fmt, config, expected, chain, mtp_only, hf.vocab_size, tol))
        log(f"verified: {len(expected)} tensors with the expected names and shapes; {K} draft step(s) through "
            f"{num_mtp} MTP layer(s), each handing the next the {handoff_mod.describe(engine)} state as {target} "
            "does; " + ", ".join(f"{k} max|diff| {v:.2e}" for k, v in summary.items() if k.startswith("max_diff")))
    target_model = out_dir if not mtp_only else "<TARGET_MODEL_DIR>"
    log(f"wrote {out_dir}: {fmt_name} for {target}{' (MTP only)' if mtp_only else ''}, {len(tensors)} tensors, "
        f"{num_mtp} MTP layer(s)")
    legacy = f" (one of {handoff_mod.VLLM_LEGACY})" if engine != handoff_mod.engine_handoffs(fmt)[target][0] else ""
    log(f"serve with{legacy}:\n  " + fmt.serve(out_dir, target, mtp_only, target_model, num_mtp, num_steps=K))
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


@dataclass(frozen=True)
class Chain:
    """The K-step chain to verify: MTP layers, steps, the target engine's hand-off (the
    reference's) and the trained one (the Megatron model's)."""

    num_layers: int
    num_steps: int
    engine: str
    trained: str
    target: str


def verify_export(out_dir, model, fmt, config, expected, chain: Chain, mtp_only, vocab, tol) -> dict:
    """Reload the files, check the key set, and compare an independent K-step MTP forward's logits."""
    if fmt.name not in verify_mod.REFERENCES or (not mtp_only and fmt.name not in verify_mod.BACKBONES):
        raise ConvertError(f"--verify has no reference forward for --format {fmt.name} (pass --no-verify)")
    written = read_all(out_dir)
    verify_mod.check_keys(written, expected)
    tokens = torch.randint(0, vocab, (2, max(16, chain.num_steps + 8)), generator=torch.Generator().manual_seed(0))
    hidden, logits = megatron_io.forward_hidden_and_logits(model, tokens, vocab)
    result = {}
    if mtp_only:
        h = hidden[0]  # the backbone is not in the files: take its final hidden state from Megatron
    else:
        h, ref_logits = verify_mod.BACKBONES[fmt.name](out_dir, written, config, tokens, fmt.name)
        result["max_diff_backbone"] = verify_mod.compare("backbone logits", logits[0], ref_logits, tol)
    # the target's embedding and head where the draft does not carry them
    sd = megatron_io.weights(model)
    emb = sd["embedding.word_embeddings.weight"][:vocab]
    head = sd["output_layer.weight"][:vocab] if "output_layer.weight" in sd else emb
    ref = verify_mod.REFERENCES[fmt.name](written, config, chain.num_layers, fmt.name, emb=emb, head=head,
                                          sglang_nextn=issubclass(fmt, Glm4Moe) and chain.target == "sglang"
                                          and mtp_only)
    drafts = verify_mod.draft_chain(ref, h, tokens, chain.num_steps, chain.engine)
    for k, ref_logits in enumerate(drafts, start=1):
        got = logits[k][:, : ref_logits.shape[1]]
        hint = (f"; the reference hands each draft step the next the {handoff_mod.describe(chain.engine)} state as "
                f"{chain.target} does, the Megatron heads were trained with mtp.next_step_input={chain.trained}"
                + (" (a hand-off mismatch)" if chain.engine != chain.trained else "")
                + ("; step 1 matched" if k == 2 else f"; steps 1-{k - 1} matched" if k > 2 else ""))
        result[f"max_diff_mtp{k}"] = verify_mod.compare(f"draft logits of MTP step {k} of {chain.num_steps}", got,
                                                        ref_logits, tol, hint)
    return result
