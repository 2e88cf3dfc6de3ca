"""The objective study (``tools/objective_study.py``): which training objective gives the best
MTP head on a given model, with intervals that a reviewer accepts.

- :mod:`.intervals`: held-out statistics and their intervals: t-intervals over seeds, a
  hierarchical bootstrap check, responses only;
- :mod:`.stages`: the import, the model's own responses, their indexed datasets (resumable);
- :mod:`.runs`: one run (config, training, held-out rows with the text of every position);
- :mod:`.driver`: every (condition, seed, objective) run, resumable, with progress and ETA;
- :mod:`.report`: RESULTS.md, CSV rows, curves per condition, the recommendation line;
- :mod:`.pack`: ``--pack``/``--unpack``, the study's portable state (no weights, no prompt text)
  carried to another machine, checked line by line when it is unpacked;
- :mod:`.fingerprint`: what a work folder was made from (the model, a ``--megatron`` import, the
  prompts): a study of others in it is refused.
"""
