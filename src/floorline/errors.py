class FloorlineError(Exception):
    """A problem the user can fix (bad name, bad file, bad number): shown as one line."""


def one_line(text: object) -> str:
    """A message over several lines (as libraries write them) as one whole line."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())
