"""Rendering shared by the CLI (and later the web page): versioned JSON and rich tables."""
