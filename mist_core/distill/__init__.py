"""Distillation: decoding with a model (sampling chains to compress, solving a test set),
supervised fine-tuning on the compressed chains, and the synthetic task of the testbed.
Torch is imported by the modules that need it, not here."""
