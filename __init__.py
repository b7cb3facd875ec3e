"""mtpkit: convert, diagnose, repair and verify MLX bundles for MTP speculative decoding."""

import os
from typing import Any

from mtpkit.decoder.model.blas import use_optimized

use_optimized()  # before anything imports MLX: its Linux wheel's own BLAS is the reference one
# float32 means float32: MLX's GPU backends otherwise multiply several float32 rows in TF32, and
# load(dtype="float32") is how greedy identity is proven (verify passes round like single steps)
os.environ.setdefault("MLX_ENABLE_TF32", "0")

from mtpkit.loaders.bundle import BundleView, open_bundle  # noqa: E402 (after the BLAS)
from mtpkit.loaders.source import NotABundle  # noqa: E402

__version__ = "0.1.0"
__all__ = ["BundleView", "NotABundle", "Result", "Runner", "__version__", "load", "open_bundle"]
_DECODER = {"load", "Runner", "Result"}


def __getattr__(name: str) -> Any:
    """The decoder pulls in mlx-lm (seconds to import): load it only when asked for."""
    if name in _DECODER:
        from mtpkit.decoder import runner

        return getattr(runner, name)
    raise AttributeError(name)
