"""One module per subcommand: `add_args(p)` and `run(args) -> int`; cli.py holds the table."""
