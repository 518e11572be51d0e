"""The Ray jobs built on mist_core. The commands (each `python -m pipelines.<name>` and
`mist <name>`, pipelines/cli.py): compress (the compression job), evaluate, report and
saliency (the evaluation), bench and soak (the benchmarks), generate, train, solve and
testbed (the distillation loop). Shared by all: settings.py (every setting, declared once),
errors.py (exit statuses, the one `error:` line), runtime.py (Ray, actor pools, GPUs),
rows.py (a corpus row into examples), sources.py and storage.py (reading corpora, object
storage). The compression job's internals are in job/ (stages, writer, output folder,
placement and progress, error budget, injected faults)."""
