class FloorlineError(Exception):
    """A problem the user can fix (bad name, bad file, bad number): shown as one line."""
