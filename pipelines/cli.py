"""The `mist` console script: `mist compress …` runs the compression job and `mist show`
looks at its output; eval, report and saliency measure and picture the methods; bench and
soak the job's cost; generate, train and solve are the distillation loop. Each command is
its product's module's main (COMMANDS); `ray job submit` uses `python -m pipelines.compress`."""
from __future__ import annotations

import sys

USAGE = """usage: mist <command> [options]

commands:
  compress   score, prune and write compressed reasoning corpora (Ray Data job);
             `mist compress --help` for its options, `mist compress` alone runs the demo
  show       look at an output: its headline, kept shares, reject reasons and a few chains
             with the dropped words marked, e.g. `mist show outputs/demo` (--html FILE: a page)
  eval       measure compression quality per method and budget; ends with its table
  report     tables and plots from `mist eval` folders, no model needed
             (docs/results/quality.md)
  saliency   one chain shaded by necessity, sufficiency and MIST's score, and what each
             budget keeps, as HTML and PNG (docs/results/saliency.html)
  bench      scoring cost in forward passes, throughput, padding, the job's overhead
             (docs/results/performance.md)
  soak       many chains through the job with memory sampled (docs/results/reliability.md)
  model-path print the local folder (or hub id) of a model spec that from_pretrained and
             trainers load, e.g. `mist model-path smollm2-135m-instruct` (converts it once)

the distillation loop (docs/guide/loop.md: generate, compress, train, solve):
  generate   sample k chains per question with a model, keep the correct ones as a corpus
             that `mist compress --adapter generic` reads
  train      fine-tune a model on a compression output's sft/ records (TRL, full or LoRA;
             --workers N through Ray Train) and save it as a model folder
  solve      answer a test set greedily under each budget γ: accuracy, chain tokens and
             achieved compression with bootstrap intervals
  testbed    the whole loop on a generated task with known needed tokens: which method
             trains the better model (docs/results/downstream.md; --smoke: a few minutes)
"""


# Each command's module (its main) and whether that main takes the program name for its help.
COMMANDS = {"compress": ("job.compress", True), "show": ("job.show", True),
            "eval": ("evaluation.evaluate", True), "report": ("evaluation.report", True),
            "saliency": ("evaluation.saliency", True),
            "generate": ("loop.generate", True), "train": ("loop.train", True),
            "solve": ("loop.solve", True), "testbed": ("loop.testbed", True),
            "bench": ("bench.scorer", True), "soak": ("bench.soak", True)}


def main(argv: list[str] | None = None) -> int:
    """`mist`: run the command that the first argument names (COMMANDS), or print the usage.

    Args:
        argv: the command line after `mist` (default: sys.argv[1:]).

    Returns:
        The exit status: the command's, 0 for --help, 2 for no command or an unknown one.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "model-path":
        return model_path(rest)
    if command in COMMANDS:
        from importlib import import_module

        module, takes_prog = COMMANDS[command]
        entry = import_module(f".{module}", __package__).main
        return entry(rest, prog=f"mist {command}") if takes_prog else entry(rest)
    print(f"mist: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


def model_path(argv: list[str]) -> int:
    """`mist model-path`: print the folder (or hub id) that from_pretrained reads for a spec.

    Args:
        argv: the command line after `mist model-path`.

    Returns:
        The exit status: 0, or 2 for a spec whose file or package is missing.
    """
    import argparse

    p = argparse.ArgumentParser(prog="mist model-path", description=(
        "Print where a model spec's weights are, for a trainer: the safetensors folder "
        "converted from a .gguf file or smollm2-135m-instruct, a local folder, or the hub id."))
    p.add_argument("spec", help="hub id, local folder, .gguf file or smollm2-135m-instruct")
    args = p.parse_args(argv)
    from mist_core.errors import MissingDependency
    from mist_core.models import model_path as path

    try:
        print(path(args.spec))
    except (FileNotFoundError, MissingDependency) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
