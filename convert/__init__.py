"""Writers: everything that produces bundle files (manifest now; the converter builds on it)."""
