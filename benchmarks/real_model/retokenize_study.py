"""How often re-tokenizing a model's decoded answers gives other ids than it sampled (issue 39).

    .venv/bin/python benchmarks/real_model/retokenize_study.py [--samples samples.jsonl] [--hf-dir DIR]

Reads ``tools/generate_responses.py`` output written with ``--hf-dir`` (it records the sampled
``prompt_ids``/``response_ids`` next to the decoded text) and re-encodes each sample's
``messages`` the way the text path trains on them (:meth:`HFTokenizer.encode_chat`: the chat
template rendering of the whole conversation, tokenized once). A sample *round-trips* when the
re-encoding starts with exactly the sampled ``prompt_ids + response_ids``; otherwise the first
differing position is classified:

- ``boundary``: at the first response token (a merge across the prompt/response boundary);
- ``special``: either side has a special token there (e.g. one the decode with
  ``skip_special_tokens`` dropped from the text);
- ``mid-text``: elsewhere in the response (a non-canonical tokenization the model sampled).

Separately it counts the stopped samples whose re-encoding adds tokens after the sampled
end-of-turn (the template's trailing text and the appended EOS), which the policy never emitted.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bebop_megatron.data.tokenizer import HFTokenizer  # noqa: E402


def classify(sampled: list[int], prompt_len: int, retok: list[int], specials: set[int]) -> str:
    if retok[: len(sampled)] == sampled:
        return "round-trips"
    d = next((i for i, (a, b) in enumerate(zip(sampled, retok)) if a != b), min(len(sampled), len(retok)))
    if d < prompt_len:
        return "prompt"
    if (d < len(sampled) and sampled[d] in specials) or (d < len(retok) and retok[d] in specials):
        return "special"
    return "boundary" if d == prompt_len else "mid-text"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", required=True, help="tools/generate_responses.py --hf-dir output")
    parser.add_argument("--hf-dir", required=True, help="the model's directory (its tokenizer and chat template)")
    args = parser.parse_args(argv)
    tok = HFTokenizer(args.hf_dir)
    specials = set(tok.tok.all_special_ids) | {int(i) for i in tok.tok.added_tokens_decoder}
    counts, extra_tail, finish, lengths = {}, 0, {}, []
    examples = {}
    for line in Path(args.samples).read_text().splitlines():
        rec = json.loads(line)
        sampled = rec["prompt_ids"] + rec["response_ids"]
        retok, _ = tok.encode_chat(rec["messages"])
        kind = classify(sampled, len(rec["prompt_ids"]), retok, specials)
        counts[kind] = counts.get(kind, 0) + 1
        finish[rec["finish_reason"]] = finish.get(rec["finish_reason"], 0) + 1
        lengths.append(len(rec["response_ids"]))
        if rec["finish_reason"] == "stop" and len(retok) > len(sampled) and retok[: len(sampled)] == sampled:
            extra_tail += 1
        if kind not in ("round-trips",) and kind not in examples:
            d = next((i for i, (a, b) in enumerate(zip(sampled, retok)) if a != b), min(len(sampled), len(retok)))
            examples[kind] = {"sampled": tok.tok.convert_ids_to_tokens(sampled[d - 2: d + 3]),
                              "re-encoded": tok.tok.convert_ids_to_tokens(retok[d - 2: d + 3])}
    total = sum(counts.values())
    print(json.dumps({"samples": total, "differ": total - counts.get("round-trips", 0), "by_first_difference": counts,
                      "stopped_with_extra_tail": extra_tail, "finish_reason": finish,
                      "mean_response_tokens": round(sum(lengths) / max(len(lengths), 1), 1),
                      "examples": examples}, indent=1))


if __name__ == "__main__":
    main()
