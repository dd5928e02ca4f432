import sys


class FloorlineError(Exception):
    """A problem the user can fix (bad name, bad file, bad number): shown as one line."""


def one_line(text: object) -> str:
    """A message over several lines (as libraries write them) as one whole line."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def exception_line(e: BaseException) -> str:
    """`Type: message` on one line; the type alone where there is no message."""
    message = one_line(e)
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


def out_of_memory(e: BaseException) -> bool:
    """Python's MemoryError, torch's CUDA out-of-memory error, or its CPU allocator's failure
    (torch is looked at only where the process has imported it)."""
    torch = sys.modules.get("torch")
    return (isinstance(e, MemoryError)
            or (torch is not None and isinstance(e, torch.cuda.OutOfMemoryError))
            or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e)))
