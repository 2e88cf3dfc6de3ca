"""``mtp.init``: how fresh MTP layers start (``bebop_megatron/model/mtp_init.py``).

On a tiny model at TP=2 (each rank sets its shard of eh_proj's identity):
``identity`` makes every MTP step return its input RMS-normalised and scaled by the RMS of
the backbone's final-norm weight (computed independently in the helper), so step 1's draft
is the backbone's own next-token distribution at a rescaled temperature; ``copy_last_layer``
copies the last decoder layer and final norm. ``auto`` resolves as documented.
"""

from __future__ import annotations

import json

from bebop_megatron.config import load_config
from bebop_megatron.model.mtp_init import resolve
from tests.helpers.launch import run_script

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=200",
        "train.seq_length=16", "train.micro_batch_size=2", "train.global_batch_size=2", "data.num_samples=8"]


def test_identity_and_copy_last_layer(tmp_path):
    """At TP=2 (rank 1 sets the second half of eh_proj's identity; TP=1 is the same code with one shard)."""
    out = tmp_path / "result.json"
    run_script("mtp_init_case.py", ["--out", str(out), "parallel.tensor=2", *TINY], nproc=2)
    result = json.loads(out.read_text())
    for step, err in result["identity"].items():
        assert err < 1e-5, (step, err)
    assert result["copy_last_layer"] == {"layer": 0.0, "final_norm": 0.0}


def test_auto_resolution():
    assert resolve(load_config(None, [])) == "random"  # Megatron's init: measured best on a real model
    assert resolve(load_config(None, ["model.backbone_checkpoint=/x"])) == "random"
    assert resolve(load_config(None, ["model.backbone_checkpoint=/x", "mtp.init=identity"])) == "identity"
    assert resolve(load_config(None, ["model.init_checkpoint=/x"])) == "random"  # its MTP weights are kept
    assert resolve(load_config(None, ["model.backbone_checkpoint=/x", "mtp.init=copy_last_layer"])) == "copy_last_layer"
