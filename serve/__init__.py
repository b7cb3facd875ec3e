"""`mtpkit serve`: an OpenAI-compatible HTTP front over the reference MTP decoder."""
