"""`python -m pipelines.compress`: the compression job's entry for `ray job submit` (the job
itself is pipelines/job/compress.py; `mist compress` runs the same)."""
import sys

from pipelines.job.compress import main

if __name__ == "__main__":
    sys.exit(main())
