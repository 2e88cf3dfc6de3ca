"""bebop_megatron: MTP draft heads on a frozen backbone with Megatron-Core (Bebop, arXiv 2606.12370)."""

from bebop_megatron.platform import lazy_imports as _lazy_imports
from bebop_megatron.platform import quiet as _quiet

_quiet.install()
_lazy_imports.install()

__version__ = "0.1.0"
