"""The typer CLI: one module per command; each parses, calls the library and renders. No arithmetic."""
