"""Forecast ms/step for a model x GPU x context x path from measured terms (see model.py)."""
