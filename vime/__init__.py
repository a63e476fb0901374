"""vime: fully-asynchronous, durable RL post-training for LLMs."""

import os as _os

__version__ = "0.1.0"

# In a source checkout the subsystem folders (workers/, queue/, recovery/, tools/) sit beside
# this package instead of inside it (an installed wheel maps them inside). Extending __path__
# lets `vime.queue` & co. resolve there without a top-level `queue` package shadowing the stdlib.
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "queue")):
    __path__.append(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
