"""The Tensile operator (Kopf): admits TrainingJobs onto shared GPUs by their scheduled memory-peak
forecasts. Imported as `tensile_operator` (setuptools maps this folder); never put the repository
root on sys.path of a process that imports the standard library's `operator` late. Flow (docs/operator.md): validate -> forecast (trace + plan
on the CPU, cached) -> place (plan each candidate GPU's jobs together with the new one; best fit) ->
pod with the hook injected -> follow the pod -> release.
"""

GROUP = "tensile.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
