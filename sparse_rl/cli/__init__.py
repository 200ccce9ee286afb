"""The command line: one thin Typer file per stage, mounted from the flat list in main.py."""
