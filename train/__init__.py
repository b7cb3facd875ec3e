"""Training: graft an MTP head onto a frozen trunk (corpus, rollouts, copy supervision, graft)."""
