"""The distillation loop: `mist generate`, `mist train`, `mist solve` (their shared flags and
helpers in base.py) and `mist testbed`, which runs the loop on the synthetic task."""
