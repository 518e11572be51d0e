"""The measures of compressed chains: answers read out of text, the paper's objective and
greedy answers (evaluation, the one module here that needs a model), what a compression
keeps (retention, taxonomy) and the corpus-level statistics (stats)."""
