"""``mtp.next_step_input``: what MTP step k hands to step k+1 (tests/helpers/chain_case.py).

Same weights in both models. Step 0 (the backbone) and step 1 never differ. With random
final-norm weights, ``pre_norm`` and ``post_norm`` differ from step 2 on (the norm's
per-channel scale reaches the next step's ``hnorm`` only in ``post_norm``); with unit weights
they agree, since RMSNorm is scale-invariant: ``hnorm(x / rms(x)) == hnorm(x)``. Which one
each engine computes is checked by the export verification over K steps
(tests/test_convert_export.py, tests/test_convert_deepseek.py: post_norm for every format by
default, pre_norm for GLM/DeepSeek with ``--vllm-handoff pre_norm``; a mismatch fails at step 2).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import run_script


@pytest.fixture(scope="module")
def diffs(tmp_path_factory):
    out = tmp_path_factory.mktemp("chain") / "result.json"
    run_script("chain_case.py", ["--out", str(out)], nproc=1)
    return json.loads(out.read_text())


@pytest.mark.parametrize("num_layers", [3, 1])
def test_pre_and_post_norm_chains(diffs, num_layers):
    random, unit = diffs[f"layers{num_layers}/random_norms"], diffs[f"layers{num_layers}/unit_norms"]
    assert random[0] == 0.0 and random[1] < 1e-6  # backbone, and step 1 (same input: h_0)
    assert min(random[2:]) > 1e-3, random  # steps 2, 3 see a differently scaled input
    assert max(unit) < 1e-4, unit
