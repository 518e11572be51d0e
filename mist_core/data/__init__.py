"""The data: reasoning examples and the corpus adapters that make them from rows (GSM8K,
MATH, generic columns, the long-CoT corpora), the prompt templates that tokenize them, the
built-in demo corpus, and the formats the compression job writes. Free of torch."""
