"""Read and write Hugging Face safetensors directories (sharded, with an index)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bebop_megatron.convert.errors import ConvertError

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)
# Without one of these no tokenizer loads from the directory (the others only add to it).
TOKENIZER_CORE_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")
EXTRA_FILES = ("generation_config.json",)  # copied too, but not a tokenizer


def _open_checked(path: str):
    """``safe_open`` whose failure (a truncated or damaged file) is one line naming the file.

    Opening checks the header and that the file covers every tensor it lists, so a truncated
    download is caught here and not halfway through the conversion."""
    try:
        return safe_open(path, "pt")
    except Exception as err:  # safetensors' SafetensorError derives from Exception only
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConvertError(f"{path} is not a readable safetensors file ({reason}): truncated or damaged? "
                           "download or copy it again") from None


class HFWeights:
    """Lazy access to the tensors of an HF directory; remembers which names were read."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        index = os.path.join(hf_dir, INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.file_of = dict(json.load(f)["weight_map"])
            except (ValueError, KeyError, TypeError) as err:  # truncated JSON, no weight_map
                raise ConvertError(f"{index} is not a valid safetensors index ({type(err).__name__}: {err})") from None
            for name in sorted(set(self.file_of.values())):
                if not os.path.isfile(os.path.join(hf_dir, name)):
                    raise ConvertError(f"missing weight file {os.path.join(hf_dir, name)} (listed in {INDEX})")
                _open_checked(os.path.join(hf_dir, name))  # a damaged file fails now, before any model is built
        else:
            files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
            if not files:
                raise ConvertError(f"no *.safetensors weights in {hf_dir} (convert .bin checkpoints with transformers first)")
            self.file_of = {}
            for name in files:
                with _open_checked(os.path.join(hf_dir, name)) as f:
                    self.file_of.update({k: name for k in f.keys()})
        self.used: set[str] = set()
        self._open: dict[str, object] = {}

    def keys(self) -> list[str]:
        return list(self.file_of)

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str) -> torch.Tensor:
        if name not in self.file_of:
            raise ConvertError(f"tensor {name} is missing from {self.dir} (config.json promises it)")
        file = self.file_of[name]
        if file not in self._open:
            self._open[file] = _open_checked(os.path.join(self.dir, file))
        self.used.add(name)
        return self._open[file].get_tensor(name)

    def unused(self) -> list[str]:
        return sorted(k for k in self.file_of if k not in self.used and "rotary_emb.inv_freq" not in k)


def write_sharded(tensors: dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int = 4 << 30,
                  progress=None) -> list[str]:
    """``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` (always)."""
    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in tensors:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map, files = {}, []
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.detach().contiguous().clone() for k, v in shard.items()},
                  os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        files.append(fname)
        if progress is not None:
            progress.update(len(shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return files


def read_all(out_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory (used by verification and tests)."""
    w = HFWeights(out_dir)
    return {k: w.get(k) for k in w.keys()}


def copy_tokenizer(src: str, dst: str) -> list[str]:
    """Copy the tokenizer files (and generation_config.json) of ``src``; returns the tokenizer
    files copied, empty when ``src`` has none that a tokenizer can load from."""
    os.makedirs(dst, exist_ok=True)
    for name in EXTRA_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
    if not any(os.path.isfile(os.path.join(src, name)) for name in TOKENIZER_CORE_FILES):
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
            copied.append(name)
    return copied


def write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
