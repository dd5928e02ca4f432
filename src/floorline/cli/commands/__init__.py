"""floorline's commands, a module per group; floorline/cli/__init__.py registers them."""
