"""Train DFlash v1 drafters for the bundled engine's targets (run as `python -m train_drafter`
with `tools/` on PYTHONPATH; see README.md). Not part of the installed package."""
