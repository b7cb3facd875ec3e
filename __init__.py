"""mtpkit: convert, diagnose, repair and verify MLX bundles for MTP speculative decoding."""

from mtpkit.loaders.bundle import BundleView, open_bundle
from mtpkit.loaders.source import NotABundle

__version__ = "0.1.0"
__all__ = ["BundleView", "NotABundle", "__version__", "open_bundle"]
