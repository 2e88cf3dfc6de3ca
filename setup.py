"""bebop_megatron: MTP draft heads trained with an end-to-end TV loss on Megatron-Core."""

from pathlib import Path

from setuptools import find_packages, setup

# tools/*.py are the command-line doors; installed as the package ``bebop_tools``, each one's ``cli()``
# is also a console script: tools/eval_acceptance.py -> bebop-eval-acceptance
TOOLS = sorted(p.stem for p in Path(__file__).resolve().parent.joinpath("tools").glob("*.py") if p.stem != "__init__")

setup(
    name="bebop_megatron",
    version="0.1.0",
    description=(
        "Megatron-Core trainer for multi-token-prediction draft heads on a frozen backbone, "
        "for speculative decoding with rejection sampling during RL rollouts"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.12",
    packages=[*find_packages(include=["bebop_megatron", "bebop_megatron.*"]), "bebop_tools"],
    package_dir={"bebop_tools": "tools"},
    entry_points={"console_scripts": [f"bebop-{name.replace('_', '-')} = bebop_tools.{name}:cli" for name in TOOLS]},
    install_requires=[
        "megatron-core>=0.19,<0.20",
        "torch>=2.6",
        "omegaconf>=2.3",
        "safetensors",
        "transformers",
        "numpy",
        "tqdm",
        "matplotlib",  # tools/eval_acceptance.py and tools/analyze_rl_acceptance.py plots
        "psutil",  # Megatron's dist-checkpointing writer workers need it
    ],
    extras_require={
        # the logging tests write tensorboard and wandb logs; the Parquet tests read Parquet
        "test": ["pytest>=8", "pytest-xdist>=3.8", "tensorboard", "wandb", "pyarrow"],
        "parquet": ["pyarrow"],  # Parquet training data (a ~55 MB wheel, so not a base dependency)
        "tensorboard": ["tensorboard"],
        # apex is optional and not listed: build it from its own source if you want it.
        "gpu": ["transformer-engine[pytorch]"],
        "wandb": ["wandb"],
    },
)
