"""Every option, declared once, and where options come from.

options.py: TrainConfig, each field also declaring its command-line option (a new option is
one new field there: its click option, its --config key and bench's spelling follow);
cli_options.py derives the click options; values.py the list and JSON value types and what a
"module:Name" spec is; formats.py the names and extensions of frame formats; files.py reads
--config files (TOML, YAML) and writes OUTPUT/config.toml.
"""
