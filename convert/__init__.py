"""Writers: everything that produces bundle files (trunk, sidecar, repairs, manifest, card)."""
