"""The benchmarks: `mist bench` (scorer.py), `mist soak` (soak.py), long chains (long.py, with
shapes.py) and the whole job timed as a subprocess (pipeline.py)."""
