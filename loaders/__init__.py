"""Readers: turn a folder into a header-only BundleView with findings. Nothing here writes."""
