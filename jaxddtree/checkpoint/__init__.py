"""Checkpoints in and out: HF safetensors key maps for the target and the DFlash drafter, the converted
(orbax) format and its fast restore, the converter behind `python -m convert`, `load_target` /
`load_drafter`, and the built-in demo pair."""
