"""Command-line entry points, ``python -m pipelines.train|evaluate|export|tune``: thin wrappers over
the ``retrieval`` command's subcommands (``retrieval/cli.py``) with their working-directory defaults."""
