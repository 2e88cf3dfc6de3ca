"""The record layouts of training files (``data.format``): the one list that the config's
validation, ``tools/preprocess_data.py --format``, :mod:`bebop_megatron.data.records` (which reads
each layout) and docs/configuration.md (checked by ``tests/test_docs.py``) use.

Adding a layout: its name and description here, its detection and its conversion to a generic
record in :mod:`bebop_megatron.data.records` (``detect`` and ``to_generic``).
"""

from __future__ import annotations

LAYOUTS = {
    "generic": "messages / prompt-response / text / token-id records",
    "verl": "a verl rollout dump (input/output texts)",
    "openrlhf": "an OpenRLHF batch_inference output (input/output texts)",
    "slime": "a slime rollout dump (tokens, response_length, loss_mask)",
}
"""Layout name -> what its records are (the log line that names a detected layout)."""

FORMATS = ("auto", *LAYOUTS)
"""``data.format``'s values: ``auto`` (detected per file from its first record) or a layout."""
