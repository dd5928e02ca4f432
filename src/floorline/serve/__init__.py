"""floorline's engine as a service: a Python API that keeps a model open (api.py) and an
OpenAI-compatible HTTP server on it (server.py, `floorline serve`)."""

from floorline.serve.api import Completion, Model, Report, RequestError

__all__ = ["Completion", "Model", "Report", "RequestError"]
