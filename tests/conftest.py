import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Ray and vLLM read these at import/start time; tests only ever talk to loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
