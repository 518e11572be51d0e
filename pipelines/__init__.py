"""The products built on mist_core, one folder each, every command behind `mist <name>`
(pipelines/cli.py):

- job/: the compression job (`mist compress`; `python -m pipelines.compress` for
  `ray job submit`) and `mist show`, its output viewer.
- evaluation/: `mist eval`, `mist report`, `mist saliency`.
- loop/: the distillation loop, `mist generate`, `mist train`, `mist solve`, `mist testbed`.
- bench/: `mist bench` (the scorer), `mist soak`, the long-chain and whole-job benchmarks.
- common/: what every product shares and none owns: the settings kit (settings.py), the
  exception classes and exit statuses (errors.py, exits.py), Ray and actor pools
  (runtime.py), corpus rows, sources and object storage (rows.py, sources.py, storage.py),
  the paged reader (page.py) and injected faults (faults.py).

A product imports common/ and mist_core, never another product (tests/test_layout.py)."""
