"""Images, beside the generic core: class-folder indexes and decoding (imagefolder), the
augmentation pipeline and the named weights' preprocessing (images), decoding and augmenting
on the device (gpu_decode), whole image sets resident on the device (device), and synthetic
ImageNet-shaped data (synthetic). The image recipes use it; the engine's core (loop, set-up,
data loading, checkpoints) never imports it, which an import-linter contract holds
(pyproject.toml's engine layers) and tests/engine/test_recipe_contract.py checks in a
process, so digits and gpt load none of it."""
