"""The scoring options' choices and defaults, declared once and free of torch: the library's
scorers and the commands' settings (which load before any model) read them here."""
ALPHA = 0.6  # MIST's necessity weight in Eq. 8, the paper's
# Eq. 7's layer weights; the first is the default (docs/results/units.md: clipped keeps more
# of the intermediate results than the paper's signed c̄_l)
LAYER_WEIGHTS = ("clipped", "signed")
ABLATIONS = ("zero", "mean")  # necessity's baseline state; zero is the paper's and the default
# What necessity's backward differentiates: log p(answer) (Eq. 1, the paper's), that plus
# the log p of the chain's own numbers and operators (what a writer of the chain needs), or
# both, each z-scored and averaged (MistScorer).
TARGETS = ("both", "answer", "facts")
# What each method takes beyond the options every scorer takes (template, max_tokens,
# max_batch, max_memory): the one-axis ablations have no α to weigh their axes with.
OPTIONS = {"mist": ("alpha", "layer_weights", "ablation", "target"),
           "necessity": ("layer_weights", "ablation", "target"),
           "sufficiency": ("layer_weights",),
           "uniform": ("seed",)}
