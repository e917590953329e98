"""Command-line tools: `python -m helpers.cli.bench`, `torchrun -m helpers.cli.train_ddp`, `python -m helpers.cli.resume`."""
