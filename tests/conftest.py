"""Shared fixtures: ``hf_dir``, a small local Hugging Face tokenizer (tests/helpers/data.py)."""

from tests.helpers.data import hf_dir  # noqa: F401
