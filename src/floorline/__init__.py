"""floorline: batch-1 LLM decode against its memory floor."""

__version__ = "0.2.0"
