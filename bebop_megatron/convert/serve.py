"""The serve command an export prints: vLLM's and SGLang's MTP speculation with rejection
sampling on (vLLM's probabilistic draft sampling; SGLang's flag, with top-k 1)."""

from __future__ import annotations


def nextn_serve_command(out: str, target: str, mtp_only: bool, target_model: str, num_steps: int) -> str:
    """``num_steps`` draft tokens per verification; ``out`` is the draft model when ``mtp_only``
    (vLLM) and SGLang's draft model path (a full export serves as its own draft)."""
    if target == "vllm":
        draft = f', "model": "{out}"' if mtp_only else ""
        return (f"vllm serve {target_model} --speculative-config '{{\"method\": \"mtp\", "
                f"\"num_speculative_tokens\": {num_steps}{draft}, \"draft_sample_method\": \"probabilistic\"}}'")
    return (f"python -m sglang.launch_server --model-path {target_model} --speculative-algorithm NEXTN "
            f"--speculative-draft-model-path {out} --speculative-num-steps {num_steps} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {num_steps + 1} --speculative-use-rejection-sampling")
