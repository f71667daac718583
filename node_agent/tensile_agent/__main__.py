"""`python -m tensile_agent [--host H] [--port P] [--simulate-gpu NAME:MEMORY ...]`."""

import sys

from tensile_agent.server import main

sys.exit(main())
