"""The evaluation: `mist eval` (evaluate.py, settings in config.py), `mist report` (report.py),
`mist saliency` (saliency.py); results.py reads and writes its results.jsonl."""
