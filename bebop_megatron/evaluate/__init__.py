"""Acceptance evaluation of trained MTP heads (``tools/eval_acceptance.py`` is its command line).

- :mod:`.options`: the checkpoint's path and the data's kind, checked before the model loads
  (no torch import), and :class:`~.options.EvalError`;
- :mod:`.statistics`: one micro-batch's acceptance statistics (also the objective study's);
- :mod:`.run`: the whole evaluation: config, held-out rows or on-policy samples, the forecast's
  labels, the speed-up model, ``report.json`` and the plots.
"""
