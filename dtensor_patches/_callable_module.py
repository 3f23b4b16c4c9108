"""Modules whose name is also the package's public function (``dtensor_patches.verify``,
``dtensor_patches.scan``).

Importing the submodule ``dtensor_patches.verify`` (``from dtensor_patches.verify import
Signatures``) makes the import system set the package's attribute ``verify`` to the module,
after the module ran, so ``dtensor_patches.verify(...)`` would then call a module. Such a module
is made callable instead: calling it calls the function of the same name.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["call_through"]


def call_through(module_name: str, function: Callable[..., Any]) -> None:
    """Make the module ``module_name`` callable as ``function``."""

    class _Callable(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

    sys.modules[module_name].__class__ = _Callable
