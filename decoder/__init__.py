"""The reference MTP decoder: exact speculative decoding over a converted bundle."""
