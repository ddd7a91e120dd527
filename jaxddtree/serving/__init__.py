"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over DDTree speculative decoding: `create_app(engine)`;
`Engine` decodes up to `max_batch` requests at once
(continuous batching over a `speculative.batch.SlotPool`). The CLI is scripts/serve.py."""

from jaxddtree.serving.engine import Engine, Job, QueueFull
from jaxddtree.serving.app import create_app

__all__ = ["Engine", "Job", "QueueFull", "create_app"]
