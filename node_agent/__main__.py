"""`python -m tensile.node_agent [--host H] [--port P] [--simulate-gpu NAME:MEMORY ...]`."""

import sys

from tensile.node_agent.server import main

sys.exit(main())
