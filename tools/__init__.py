"""Developer tools (reliability harnesses); not part of the installed package."""
