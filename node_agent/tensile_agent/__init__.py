"""The Tensile node agent (docs/agent.md): one per GPU node; plans all jobs of each GPU together, hands each
runtime hook its plan, learns from what the hooks measure, and exports what the dashboards show.

Run it with `tensile agent` or `python -m tensile_agent`. Modules: gpus (NVML inventory or
simulated GPUs), state (jobs, plans, tokens), planning (global planning rounds off the event loop),
service (what each call does), app (FastAPI routes), metrics (Prometheus), cluster (TensileNode and
TrainingJob status), server (wiring and uvicorn). The HTTP contract lives in tensile.agent_contract.
"""
