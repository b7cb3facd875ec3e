"""Where drafts are made: the `Draft` record, the `Proposer` protocol, and every drafter behind it
(the context, a draft model, Gemma 4's assistant, DFlash; the head's proposer is in proposers.py)."""
