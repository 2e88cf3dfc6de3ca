"""bebop_megatron: MTP draft heads on a frozen backbone with Megatron-Core (Bebop, arXiv 2606.12370)."""

from bebop_megatron.platform import quiet as _quiet

_quiet.install()

__version__ = "0.1.0"
