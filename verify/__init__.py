"""Checks that consume a BundleView: doctor (header checks + deep data scan)."""
