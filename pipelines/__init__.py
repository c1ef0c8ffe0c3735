"""Command-line entry points: parse arguments, load the config, call the library."""
