"""Training recipes for the demo pair: the tokenizer on the Python standard library, target and DFlash
drafter training, and HF-layout exports (used by `scripts/train_target.py` / `scripts/train_drafter.py`)."""
