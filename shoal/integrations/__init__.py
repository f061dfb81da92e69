"""Adapters to other projects' interfaces (RL frameworks), each a thin layer over shoal's one
implementation of the RL verbs; none imports its framework at import time."""
