"""Reports of results documents: markdown tables and PNG plots."""

from .markdown import render_report  # noqa: F401
