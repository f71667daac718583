"""Local mode (docs/local-mode.md): TrainingJob files run on this machine, sharing one GPU (or a simulated one) by their
forecast scheduled peaks, with the node agent in-process and each job under the hook.

Above the core and the deployables it starts (the agent, the hook), below the CLI: `tensile local` parses its
arguments and calls `session.run_jobs`.
"""
