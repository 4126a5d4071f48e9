"""Drafters: models that propose a block of tokens for the target to verify in one forward."""
