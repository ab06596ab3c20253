"""Structured output: token bitmasks for the grammar backends that implement core.structured_output."""
