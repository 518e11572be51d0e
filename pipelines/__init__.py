"""The Ray jobs built on mist_core. The commands (each `python -m pipelines.<name>` and
`mist <name>`, pipelines/cli.py): compress (the compression job), evaluate, report and
saliency (the evaluation), bench and soak (the benchmarks), generate, train, solve and
testbed (the distillation loop). Shared by all: settings.py (every setting, declared once),
errors.py (exit statuses, the one `error:` line), runtime.py (Ray, actor pools, GPUs),
rows.py (a corpus row into examples), sources.py and storage.py (reading corpora, object
storage). The job's internals: stages.py (validate, score, prune), sink.py and output.py
(writing), placement.py (where actors run, progress), budget.py (the error budget),
faults.py (fault injection for tests)."""
