"""Speculative-decoding drafts for `--speculative draft|eagle`: `switchyard make-draft` (a draft cut from the
target) and `switchyard train-draft` (an EAGLE head distilled from the target)."""
