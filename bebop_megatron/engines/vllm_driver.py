"""Runs inside the engine venv (``tools/engines/vllm_env.sh``), by path, not as part of the
package: it imports only vLLM and the standard library.

``python vllm_driver.py REQUEST.json RESULT.json``. The request names the export, the prompts
(token ids), ``max_tokens``, the draft counts K to serve and the temperatures; for every K
(0: no speculation) one ``vllm.LLM`` is made in this process and generates every temperature.
The result holds, per run, the output token ids, the seconds and tokens, and vLLM's own
speculative counters (``SpecDecodingStats.observe_draft``, the numbers vLLM's metrics export:
drafts, draft tokens, accepted tokens per position); and per load, which tensors of the files
were copied into a parameter of the target or the draft model (consumed) and which were not,
and vLLM's own error when its loader finds a parameter the files do not initialize.
"""

import gc
import json
import os
import sys
import time
import traceback


def _install_hooks(state):
    """Count vLLM's speculative statistics and track which checkpoint tensors are consumed."""
    import torch
    from vllm.model_executor.model_loader import default_loader
    from vllm.v1.spec_decode import metrics

    observe = metrics.SpecDecodingStats.observe_draft

    def observe_draft(self, num_draft_tokens, num_accepted_tokens):
        c = state["counters"]
        if c is not None:
            c["num_drafts"] += 1
            c["num_draft_tokens"] += num_draft_tokens
            c["num_accepted_tokens"] += num_accepted_tokens
            per = c["accepted_per_pos"]
            per.extend([0] * (num_accepted_tokens - len(per)))
            for i in range(num_accepted_tokens):
                per[i] += 1
        return observe(self, num_draft_tokens, num_accepted_tokens)

    metrics.SpecDecodingStats.observe_draft = observe_draft

    # The same counts per request (keyed by its prompt), from the scheduler's call that feeds them.
    from vllm.v1.core.sched import scheduler

    make_stats = scheduler.Scheduler.make_spec_decoding_stats

    def make_spec_decoding_stats(self, stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens,
                                 request_id):
        per = state["per_prompt"]
        request = self.requests.get(request_id)
        if per is not None and request is not None and num_draft_tokens and self.log_stats:
            c = per.setdefault(json.dumps(list(request.prompt_token_ids)),
                               {"num_drafts": 0, "accepted_per_pos": []})
            c["num_drafts"] += 1
            c["accepted_per_pos"].extend([0] * (num_accepted_tokens - len(c["accepted_per_pos"])))
            for i in range(num_accepted_tokens):
                c["accepted_per_pos"][i] += 1
        return make_stats(self, stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id)

    scheduler.Scheduler.make_spec_decoding_stats = make_spec_decoding_stats

    # Every tensor the loader reads from the files is kept (so its storage is not reused) and
    # indexed by its storage; a tensor is consumed when a weight loader copies from it (or a
    # view of it) into a parameter.
    get_all = default_loader.DefaultModelLoader.get_all_weights

    def get_all_weights(self, model_config, model):
        for name, tensor in get_all(self, model_config, model):
            state["read"].setdefault(name, []).append(tensor)
            state["by_storage"][tensor.untyped_storage().data_ptr()] = name
            yield name, tensor

    default_loader.DefaultModelLoader.get_all_weights = get_all_weights
    copy = torch.Tensor.copy_

    def copy_(self, src, *args, **kwargs):
        if state["by_storage"] and isinstance(src, torch.Tensor):
            try:
                name = state["by_storage"].get(src.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                name = None
            if name is not None:
                state["consumed"].add(name)
        return copy(self, src, *args, **kwargs)

    torch.Tensor.copy_ = copy_


def _fix_cpu_expand(state):
    """vLLM 0.32's CPU fallback for the rejection sampler's ``expand_kernel``
    (``vllm/utils/cpu_triton_utils.py``, ``_expand_kernel_impl``) passes int64 copies of its
    tensors to the C++ op, so the float32 per-token temperatures (and top-p) it should write stay
    uninitialized memory: at T > 0 speculative verification divides the target logits by garbage
    (NaN or nonsense probabilities). Replaced by the same expansion in torch; ``state`` records
    whether vLLM's own result differed on the first real call."""
    import torch
    from vllm.v1.sample import rejection_sampler as rs

    orig = rs.expand_batch_to_tokens

    def expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        src = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        out = x.new_zeros(num_tokens)
        flat = torch.repeat_interleave(src, counts)
        out[:flat.numel()] = flat[:num_tokens]
        if state["expand_differs"] is None:
            state["expand_differs"] = not torch.equal(orig(x, cu_num_tokens, num_tokens, replace_from, replace_to), out)
        return out

    rs.expand_batch_to_tokens = expand


def _files(model_dir):
    """Tensor names in the export's safetensors files (header only)."""
    names = []
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            with open(os.path.join(model_dir, f), "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            names += [k for k in header if k != "__metadata__"]
    return sorted(names)


def _make_llm(req, K):
    from vllm import LLM

    kwargs = dict(model=req["model"], dtype=req.get("dtype", "float32"), enforce_eager=True,
                  trust_remote_code=True, skip_tokenizer_init=True, max_model_len=req["max_model_len"],
                  seed=req.get("seed", 0), disable_log_stats=False,
                  gpu_memory_utilization=req.get("memory_fraction", 0.1))
    if K:
        spec = {"method": req.get("method", "mtp"), "num_speculative_tokens": K,
                "draft_sample_method": req.get("draft_sample_method", "greedy")}
        if req.get("draft_model"):
            spec["model"] = req["draft_model"]
        kwargs["speculative_config"] = spec
    return LLM(**kwargs)


def _generate(llm, req, K, temperature):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    max_tokens = req["max_tokens"] + (req.get("extra_tokens", 0) if K == 0 and temperature == 0 else 0)
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                             seed=None if temperature == 0 or not req.get("request_seeds", True) else req.get("seed", 0) + i,
                             detokenize=False)
              for i in range(len(req["prompts"]))]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, seconds


def main(argv):
    req_path, out_path = argv
    with open(req_path) as f:
        req = json.load(f)
    import vllm

    state = {"counters": None, "per_prompt": None, "read": {}, "by_storage": {}, "consumed": set(),
             "expand_differs": None}
    _install_hooks(state)
    if req.get("fix_cpu_expand", True):
        _fix_cpu_expand(state)
    result = {"vllm_version": vllm.__version__, "runs": [], "loads": []}
    files = _files(req["model"]) + (_files(req["draft_model"]) if req.get("draft_model") else [])
    try:
        for K in [0, *req["num_steps"]]:
            state.update(read={}, by_storage={}, consumed=set())
            try:
                llm = _make_llm(req, K)
            except Exception as err:  # vLLM's own refusal or loader error, reported as is
                result["loads"].append({"K": K, "error": f"{type(err).__name__}: {err}",
                                        "traceback": traceback.format_exc()[-4000:]})
                break
            read = sorted(state["read"])
            result["loads"].append({"K": K, "read": read, "consumed": sorted(state["consumed"]),
                                    "unconsumed": sorted(set(read) - state["consumed"]),
                                    "not_read": sorted(set(files) - set(read))})
            state.update(read={}, by_storage={})
            for T in (req["temperatures"] if K or req.get("plain_all_temperatures", True) else [0.0]):
                counters = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                            "accepted_per_pos": [0] * K}
                state["counters"] = counters
                state["per_prompt"] = {}
                try:
                    tokens, seconds = _generate(llm, req, K, T)
                except Exception as err:
                    result["loads"][-1]["error"] = f"{type(err).__name__}: {err}"
                    result["loads"][-1]["traceback"] = traceback.format_exc()[-4000:]
                    return 0
                finally:
                    state["counters"] = None
                    per_prompt, state["per_prompt"] = state["per_prompt"], None
                result["runs"].append({"K": K, "temperature": T, "outputs": tokens, "seconds": seconds,
                                       "tokens": sum(len(t) for t in tokens), **({"spec": counters} if K else {}),
                                       **({"spec_per_prompt": [per_prompt.get(json.dumps(list(p)))
                                                               for p in req["prompts"]]} if K else {})})
            del llm
            gc.collect()
    finally:
        result["files"] = files
        result["cpu_expand_fixed"] = req.get("fix_cpu_expand", True)
        result["cpu_expand_was_wrong"] = state["expand_differs"]
        with open(out_path, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
