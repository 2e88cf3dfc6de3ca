"""Load a training checkpoint or an export directory for speculative decoding and run it
over prompts (the logic of ``tools/speculative_generate.py`` and
``benchmarks/speculative.py``).

A training checkpoint is read as ``tools/eval_acceptance.py`` reads it: the run's config from
the checkpoint, the backbone from its ``model.backbone_checkpoint`` / ``model.init_checkpoint``
(or the same seeded random initialisation), the trained MTP layers from the checkpoint. An
export directory of ``tools/convert_to_hf.py`` (full, not ``--mtp-only``) is imported in
memory with the importer of ``tools/convert_from_hf.py``, its MTP layers included. Single
process, TP=1, PP=1.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch

from bebop_megatron.speculative.decoding import Generation, autoregressive_steps, lockstep, speculative_steps
from bebop_megatron.speculative.measure import measured, predicted, teacher_forced_rows


def is_export(path: str) -> bool:
    """An export directory of ``tools/convert_to_hf.py`` (a Hugging Face layout: ``config.json``
    and safetensors) rather than a training checkpoint."""
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, "latest")) \
        and not os.path.isfile(os.path.join(path, "metadata.json"))


def resolve_checkpoint(path: str) -> str:
    """A save.dir (its ``latest``), one ``iter_N`` directory, or an export directory, checked
    with plain ``os``."""
    if is_export(path):
        return path
    marker = os.path.join(path, "latest")
    if os.path.isfile(marker):
        with open(marker) as f:
            found = os.path.join(path, f.read().strip())
        if os.path.isfile(os.path.join(found, "metadata.json")):
            return found
        raise ValueError(f"checkpoint not found: {marker} names {found}, which is not a complete checkpoint")
    from bebop_megatron.config.checkpoints import import_given_as_training_checkpoint

    problem = import_given_as_training_checkpoint(path)  # eval_acceptance.py's check
    if problem:
        raise ValueError(problem)
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    raise ValueError(f"checkpoint not found: {path} (expected a save.dir with 'latest', an iter_N directory, or an "
                     "export directory of tools/convert_to_hf.py with config.json)")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_export(path: str, device: str = "cpu", handoff: str = "post_norm", num_steps: int | None = None):
    """``(model, cfg)`` from a full export directory (tools/convert_to_hf.py): imported in memory
    as tools/convert_from_hf.py imports it (fp32, TP=1), its MTP layers included. ``handoff``:
    what draft step k hands step k+1 (``post_norm``, as current vLLM and SGLang run every
    format; ``pre_norm`` for DeepSeek-V3 / GLM-4.5 drafts in vLLM before PR #45895); the
    export itself does not record it."""
    from bebop_megatron.convert.errors import ConvertError
    from bebop_megatron.convert.handoff import HANDOFFS
    from bebop_megatron.convert.hf_io import HFWeights
    from bebop_megatron.convert.importer import load_hf_model

    if device != "cpu":
        raise ValueError("an export directory is imported on the CPU; pass device cpu")
    if handoff not in HANDOFFS:
        raise ValueError(f"handoff must be one of {', '.join(HANDOFFS)}, got {handoff!r}")
    backbone = ("model.layers.0.", "model.language_model.layers.0.")
    if not any(k.startswith(backbone) for k in HFWeights(path).keys()):
        raise ValueError(f"{path} holds no backbone layers (an --mtp-only export?): speculative decoding needs the "
                         "target model too; export without --mtp-only, or pass the training checkpoint")
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise ValueError(f"{path} holds no tokenizer files ({', '.join(_TOKENIZER_FILES)}); the prompts' chat template "
                         "comes from the model's tokenizer")
    try:
        imported = load_hf_model(path, mtp_num_steps=num_steps, next_step_input=handoff, progress=False,
                                 log=lambda line: print(line, file=sys.stderr, flush=True))
    except ConvertError as err:
        raise ValueError(f"{path}: {err}") from None
    cfg = imported.cfg
    cfg.data.tokenizer = os.path.abspath(path)
    if not imported.hf.num_mtp_layers:
        raise ValueError(f"{path} holds no MTP layers ({imported.hf.family}); export the trained heads with "
                         "tools/convert_to_hf.py")
    imported.model.eval()
    return imported.model, cfg


def load(checkpoint: str, device: str = "cpu", precision: str | None = None, handoff: str | None = None):
    """``(model, cfg)``: the trained model at TP=1, PP=1 in eval mode; ``precision`` (fp32 or
    bf16) replaces the run's (dist checkpointing casts the stored weights on load). An export
    directory goes to :func:`load_export` instead. ``handoff`` (``post_norm`` / ``pre_norm``):
    what draft step k hands step k+1, as the chosen engine runs it; default the trained
    ``mtp.next_step_input`` (``post_norm`` for an export, which does not record it)."""
    from omegaconf import OmegaConf

    from bebop_megatron.config import load_config
    from bebop_megatron.platform import init_distributed
    from bebop_megatron.training import synthetic_backbone
    from bebop_megatron.training.checkpoint import read_common_state
    from bebop_megatron.training.model_weights import load_trained_model
    from bebop_megatron.training.parallel import setup_parallel
    from bebop_megatron.training.resume import damage

    path = resolve_checkpoint(checkpoint)
    if is_export(path):
        if precision not in (None, "fp32"):
            raise ValueError("an export directory is imported in fp32")
        return load_export(path, device, handoff or "post_norm")
    _, world = init_distributed(device)
    if world != 1:
        raise ValueError("speculative decoding runs in one process (TP=1); launch without torchrun")
    problem = damage(path)
    if problem:
        raise ValueError(f"checkpoint {path} is damaged: {problem}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        common = read_common_state(path)
    if "config_yaml" not in common:
        raise ValueError(f"{path}: the checkpoint holds no config_yaml (not written by the trainer?)")
    saved = OmegaConf.to_container(OmegaConf.create(common["config_yaml"]))
    overrides = [f"device={device}", "parallel.tensor=1", "parallel.pipeline=1", "parallel.pipeline_layout=null",
                 "parallel.context=1", "parallel.sequence_parallel=false", "parallel.expert=1",
                 "parallel.expert_tensor=null", "train.micro_batch_size=1", "train.global_batch_size=1"]
    if precision is not None:
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
        overrides.append(f"precision={precision}")
    elif saved.get("precision") == "fp8":
        overrides.append("precision=bf16")
    if handoff is not None:
        from bebop_megatron.convert.handoff import HANDOFFS

        if handoff not in HANDOFFS:
            raise ValueError(f"handoff must be one of {', '.join(HANDOFFS)}, got {handoff!r}")
        overrides.append(f"mtp.next_step_input={handoff}")
    cfg = load_config(None, overrides, defaults=saved)
    setup_parallel(cfg, world)
    # A run on the fitted synthetic backbone (model.backbone_init=fit_synthetic): rebuilt when its
    # cache entry is missing, as tools/eval_acceptance.py does.
    synthetic_backbone.prepare(cfg, 0, log=lambda line: print(line, file=sys.stderr, flush=True))
    return load_trained_model(cfg, path, device), cfg


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation rendered with the generation prompt (the chat template of an HF
    tokenizer; the byte tokenizer's own format followed by its assistant marker)."""
    from bebop_megatron.data.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode_chat(messages)[0] + [ByteTokenizer.ASSISTANT]
    text = tokenizer.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text)  # the template writes any BOS itself (as apply_chat_template tokenizes)


def stop_ids_of(tokenizer) -> set[int]:
    """End of turn: EOS plus, for chat templates, the token that ends an assistant turn."""
    from bebop_megatron.data.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return {ByteTokenizer.EOS, ByteTokenizer.END}
    ids = {tokenizer.eos_id}
    for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.tok.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid >= 0 and tid != tokenizer.tok.unk_token_id:
            ids.add(tid)
    return ids


def run_config(spec_model, prompts: list[list[int]], *, gamma: int, temperature: float, mode: str,
               max_new_tokens: int, seed: int, stop_ids=(), baseline: bool = False, baseline_model=None,
               progress=None) -> dict:
    """Speculative decoding of every prompt; with ``baseline`` also plain decoding of the same
    prompt: advanced in lockstep with it on ``baseline_model`` (a second cache of the same
    model) when given, else right after it on ``spec_model``. Returns the measured and
    predicted statistics (and the speed-up)."""
    gens, alphas, plain, predict_seconds = [], [], [], 0.0
    for i, ids in enumerate(prompts):
        seed_i = seed * 1_000_003 + i
        gen = Generation(len(ids), list(ids))
        steps = speculative_steps(spec_model, gen, gamma=gamma, temperature=temperature, max_new_tokens=max_new_tokens,
                                  mode=mode, generator=torch.Generator().manual_seed(seed_i), stop_ids=stop_ids)
        if baseline:
            plain.append(Generation(len(ids), list(ids)))
            plain_steps = autoregressive_steps(baseline_model or spec_model, plain[-1], temperature=temperature,
                                               max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                               generator=torch.Generator().manual_seed(seed_i))
        if baseline and baseline_model is not None:
            lockstep(steps, plain_steps)
        else:
            lockstep(steps)
        gens.append(gen)
        t0 = time.perf_counter()
        alphas.append(teacher_forced_rows(spec_model, gen, gamma, temperature, mode, max_new_tokens=max_new_tokens,
                                          stop_ids=stop_ids))
        predict_seconds += time.perf_counter() - t0
        if baseline and baseline_model is None:
            lockstep(plain_steps)
        if progress:
            progress(i + 1, len(prompts))
    return summarize(gens, alphas, plain, gamma=gamma, temperature=temperature, mode=mode,
                     max_new_tokens=max_new_tokens, seed=seed, predict_seconds=predict_seconds)


def run_config_batched(batched_model, tf_model, prompts: list[list[int]], *, gamma: int, temperature: float,
                       mode: str, max_new_tokens: int, seed: int, stop_ids=(), baseline: bool = False,
                       batch_size: int = 16, progress=None) -> dict:
    """:func:`run_config` with the batched decoder (:class:`~bebop_megatron.speculative.batched_spec.BatchedSpecModel`):
    the prompts in batches of ``batch_size``, in order, prompt i with the same seed as
    :func:`run_config` gives it (so the same tokens, up to batched float rounding). With
    ``baseline`` each batch is also decoded plainly (one target forward per token, its own
    caches), advanced round by round in turn with the speculative batch. The teacher-forced
    values come from ``tf_model`` (a :class:`~bebop_megatron.speculative.megatron_model.MegatronSpecModel`
    of the same model). Wall times: each batched call's time is split evenly over the rows
    it ran, so the sums are the batches' wall times."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    gens, alphas, plain, predict_seconds = [], [], [], 0.0
    for lo in range(0, len(prompts), batch_size):
        chunk = prompts[lo: lo + batch_size]
        seeds = [seed * 1_000_003 + lo + j for j in range(len(chunk))]
        outs = [Generation(len(ids), list(ids)) for ids in chunk]
        kw = dict(temperature=temperature, max_new_tokens=max_new_tokens, mode=mode, stop_ids=stop_ids)
        steps = [batched_model.generate_steps(chunk, seeds, outs, gamma=gamma, **kw)]
        if baseline:
            plain_outs = [Generation(len(ids), list(ids)) for ids in chunk]
            steps.append(batched_model.generate_steps(chunk, seeds, plain_outs, gamma=0, **kw))
            plain += plain_outs
        lockstep(*steps)
        gens += outs
        t0 = time.perf_counter()
        alphas += [teacher_forced_rows(tf_model, gen, gamma, temperature, mode, max_new_tokens=max_new_tokens,
                                       stop_ids=stop_ids) for gen in outs]
        predict_seconds += time.perf_counter() - t0
        if progress:
            progress(len(gens), len(prompts))
    return summarize(gens, alphas, plain, gamma=gamma, temperature=temperature, mode=mode,
                     max_new_tokens=max_new_tokens, seed=seed, predict_seconds=predict_seconds)


def summarize(gens, alphas, plain, *, gamma, temperature, mode, max_new_tokens, seed, predict_seconds=0.0) -> dict:
    result = {"gamma": gamma, "temperature": temperature, "mode": mode, "max_new_tokens": max_new_tokens,
              "num_prompts": len(gens), "seed": seed, **measured(gens, gamma), **predicted(gens, alphas, gamma),
              "predict_seconds": predict_seconds}
    wall = result["wall_seconds"]
    result["tokens_per_second"] = result["new_tokens"] / max(wall["prefill"] + wall["target"] + wall["draft"], 1e-12)
    if plain:
        result["baseline"] = baseline_stats(plain)
        decode = result["wall_seconds"]["target"] + result["wall_seconds"]["draft"]
        result["speedup"] = result["baseline"]["seconds_per_token"] / (decode / max(result["new_tokens"], 1))
    result["texts"] = [g.new_tokens for g in gens]
    return result


def baseline_stats(plain) -> dict:
    tokens = sum(len(g.new_tokens) for g in plain)
    seconds = sum(g.target_seconds for g in plain)
    wall = seconds + sum(g.prefill_seconds for g in plain)
    return {"new_tokens": tokens, "target_forwards": sum(g.target_forwards for g in plain), "seconds": seconds,
            "tokens_per_second": tokens / max(wall, 1e-12),
            # the first token of each prompt comes from the prefill, as for speculative decoding
            "seconds_per_token": seconds / max(tokens, 1)}
