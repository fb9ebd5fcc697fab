"""verl: an EasyR1-style RL trainer for language models with speculative off-policy guidance."""

__version__ = "0.1.0"
