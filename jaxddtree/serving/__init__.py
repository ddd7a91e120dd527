"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over DDTree speculative decoding: `create_app(engine)`;
`Engine` runs one request at a time on the device. The CLI is scripts/serve.py."""

from jaxddtree.serving.engine import Engine, Job, QueueFull
from jaxddtree.serving.app import create_app

__all__ = ["Engine", "Job", "QueueFull", "create_app"]
