"""The compression job: its command and driver (compress.py) and settings (config.py), the
stages every row passes (stages.py: validate and tokenize, score, prune), the writer
(sink.py) and the output folder it writes (output.py), the one-writer lease on that folder
(lease.py), where the scoring actors run and the progress line (placement.py), the error
budget (budget.py), and `mist show`, the output viewer (show.py)."""
