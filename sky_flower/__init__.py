"""sky-flower: load-balanced split-model training on heterogeneous Flower nodes.

Planning (``profile``, ``cost``, ``partition``, ``stage``) is pure PyTorch / SciPy;
Flower appears only in ``client`` (ClientApp handlers), ``run`` (Hydra entry point) and
the ``strategies`` package (``sky_flower.strategies.sky.SkyStrategy``).
"""

__version__ = "0.1.0"

from sky_flower.threadsafe_ast import install as _install_threadsafe_ast

_install_threadsafe_ast()  # python/cpython#106905 on Python < 3.13 (see the module)
