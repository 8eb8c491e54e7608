"""Emulation state: the graph being recorded, and how deep inside emulated ops the code runs."""
recording = None
depth = 0
