"""A subprocess with this directory on PYTHONPATH runs lmdeploy's ascend device on the emulation."""
import activate

activate.activate()
