"""The command-line doors over the package, one argparse module each, run as scripts
(``python tools/eval_acceptance.py ...``) or, installed as the ``bebop_tools`` package, as the
console scripts setup.py lists (``bebop-eval-acceptance ...``): each module's ``cli()``."""
